"""Each capped ps's memory over a `psworker local --ps_memory_limit` run, split as its cgroup counts it (issue 28).

The launcher's own peak line gives each ps's peak RSS (TensorFlow's shared libraries included) and its cgroup's peak
(page cache included: the checkpoint shards it writes fill it up to the cap, and are reclaimed there). This runs the
same command and samples every ps cgroup's `memory.stat` every 0.1 s, so the anonymous memory (`rss`: the
variables, their copies, the runtime) and the page cache (`cache`) peak apart:

    PYTHONPATH=$PWD PSWORKER_MODELS=criteo_big python benchmarks/ps_memory.py cluster_specs/criteo-4ps.yaml \\
        --model criteo_big --data_dir /tmp/criteo --max_steps 300 --batch_size 256 --ps_memory_limit 2.4GiB \\
        --checkpoint_every 600s

Prints the launcher's output, then one line per ps and a JSON line. `--quick` (for tests/test_benchmarks.py) runs
1 ps + 1 worker of the MLP for 20 steps under a 1 GiB cap instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from psworker.launcher.cgroups import own_memory_cgroup  # noqa: E402

SAMPLE_SECS = 0.1


def _stat(cgroup: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in (cgroup / "memory.stat").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def quick_argv(workdir: Path) -> list[str]:
    """`psworker local`'s arguments for a quick run: 1 ps + 1 worker of the MLP, 20 steps, a 1 GiB cap."""
    from psworker.testing import write_spec

    spec = write_spec(workdir / "quick.yaml", num_ps=1, num_workers=1, model="mlp", max_steps=20, log_every_steps=5)
    return [str(spec), "--train_dir", str(workdir / "train"), "--console", "plain", "--ps_memory_limit", "1GiB"]


def main(argv: list[str]) -> int:
    if argv == ["--quick"]:
        with tempfile.TemporaryDirectory(prefix="psworker-ps-memory-") as tmp:
            return main(quick_argv(Path(tmp)))
    if "--ps_memory_limit" not in argv:
        sys.exit("ps_memory.py: give psworker local's arguments, --ps_memory_limit among them")
    launcher = subprocess.Popen([sys.executable, "-m", "psworker", "local", *argv])
    parent, peaks = own_memory_cgroup(), {}
    while launcher.poll() is None:
        for cgroup in parent.glob(f"psworker-{launcher.pid}-*-ps-*"):
            stat = _stat(cgroup)
            if stat:
                name = "ps:" + cgroup.name.rsplit("-", 1)[1]
                old = peaks.get(name, {"rss": 0, "cache": 0})
                peaks[name] = {k: max(old[k], stat[k]) for k in ("rss", "cache")}
        time.sleep(SAMPLE_SECS)
    for name, peak in sorted(peaks.items()):
        print(f"{name}: anonymous memory peak {peak['rss'] / 2 ** 20:.0f} MiB, page cache peak "
              f"{peak['cache'] / 2 ** 20:.0f} MiB (memory.stat, sampled every {SAMPLE_SECS:g} s)")
    print(json.dumps({"exit": launcher.returncode, "peaks": peaks}))
    return launcher.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
