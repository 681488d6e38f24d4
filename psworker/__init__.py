"""psworker: launch TensorFlow parameter-server clusters from a YAML spec and train between-graph.

The public API is small and TensorFlow-free to import; the trainer and backends load on demand.
`psworker.testing` starts a real local cluster from a test.
"""

from psworker.errors import (PeerGone, PsworkerError, SpecError, StartupTimeout, StepTimeout, StoppedEarly,
                             TrainingFailed, UsageError)
from psworker.spec import (Address, ClusterSpec, TrainConfig, dump_spec, has_auto_ports, load_spec,
                           merge_train, parse_spec, with_addresses)

__version__ = "0.1.0"

__all__ = [
    "Address", "ClusterSpec", "TrainConfig", "load_spec", "parse_spec", "merge_train", "dump_spec",
    "with_addresses", "has_auto_ports",
    "PsworkerError", "SpecError", "UsageError", "StartupTimeout", "PeerGone", "StepTimeout", "StoppedEarly",
    "TrainingFailed", "__version__",
]
