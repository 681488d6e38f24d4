"""How many lines the console of a large local run has (issue 27: at most 150 for 4 ps + 24 workers).

Not a test (28 tasks take 2-3 minutes on 2 cores): run it by hand, e.g. `python benchmarks/console_lines.py` (4 ps,
24 workers, MLP, 3,000 steps, the defaults) or `--ps 2 --workers 8 --max_steps 600`. Runs `psworker local` with its
console on a pipe (plain status lines every 15 s, as on CI), stdout and stderr together, and prints the console's
line count, the lines of each kind, then a JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from psworker import events  # noqa: E402


def kind_of(line: str) -> str:
    """A console line's kind: the launcher's own, a step line, or a task's line without numbers."""
    if line.startswith("psworker: status:"):
        return "status"
    if line.startswith("psworker: "):
        return "launcher: " + re.sub(r"\d+", "#", line[10:])[:40]
    if events.parse_step(line) is not None:
        return "step"
    text = line.partition("] ")[2]
    return re.sub(r"\d+(\.\d+)?", "#", text)[:60]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=24)
    parser.add_argument("--max_steps", type=int, default=3000)
    parser.add_argument("--save", metavar="PATH", help="also write the console there")
    parser.add_argument("--quick", action="store_true", help="1 ps + 1 worker, 20 steps (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.ps, args.workers, args.max_steps = 1, 1, 20
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "cluster.yaml")
        spec.write_text(yaml.safe_dump({"cluster": {"ps": ["localhost:auto"] * args.ps,
                                                    "worker": ["localhost:auto"] * args.workers},
                                        "train": {"model": "mlp", "mode": "async", "max_steps": args.max_steps}}))
        began = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(Path(tmp, "t"))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        seconds = time.monotonic() - began
    lines = run.stdout.splitlines()
    if args.save:
        Path(args.save).write_text(run.stdout)
    kinds = collections.Counter(kind_of(line) for line in lines)
    for kind, count in kinds.most_common():
        print(f"{count:4d}  {kind}")
    print(f"{len(lines)} console lines, exit {run.returncode}, {seconds:.0f} s")
    print(json.dumps({"ps": args.ps, "workers": args.workers, "max_steps": args.max_steps, "lines": len(lines),
                      "exit": run.returncode, "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
