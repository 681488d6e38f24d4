"""`--ps_link_rate`: each ps task's port gets a link of its own on `lo`, like a full-duplex NIC per ps host.

Inside a private network namespace, an HTB qdisc on `lo` gives every ps port two classes at RATE: traffic to the
port (`match ip dport P`) and traffic from it (`match ip sport P`: the variables the workers pull). The gradients
travel the other way on the *workers'* ports: TensorFlow's receiver pulls a tensor (RecvTensor), so a ps fetches
each gradient from a worker's server. Traffic from the worker ports (`match ip sport W`) therefore goes to one
pooled class at RATE x (number of ps), the ps links' inbound side taken together (ports alone cannot tell which
ps pulled). Everything else goes to a fast default class.
The pure part (parsing RATE as tc does, the tc argv lists, reading the class counters) is apart from the one
function that runs tc, so benchmarks can shape their own namespaces the same way.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["DEFAULT_CLASS", "FAST_RATE_BPS", "LinkShaping", "PULLED_CLASS", "PortBytes", "class_bytes", "format_bytes",
           "format_rate", "install", "missing_tool", "parse_class_bytes", "parse_rate", "port_bytes",
           "read_counters", "report_lines", "setup_argvs"]

TC = "tc"
HANDLE = "1:"
DEFAULT_CLASS = "1:1"
PULLED_CLASS = "1:2"                    # sport of any worker port: gradients the ps tasks pull, all ps together
FAST_RATE_BPS = 100_000_000_000         # the unshaped default class: far above what loopback carries
_FIRST_MINOR = 0x10                     # ps i: to-port class 1:(0x10+2i), from-port class 1:(0x11+2i)
_MIN_BURST_BYTES = 2 * 65536            # above loopback's largest (GSO) packet, or HTB stalls on it
_BURST_SECS = 0.01                      # else 10 ms at RATE

# tc(8)'s rate units (tc_util.c), matched case-insensitively: bits, or bytes per second (Bps).
_UNITS = {"bit": 1, "kibit": 1024, "kbit": 1000, "mibit": 1024 ** 2, "mbit": 10 ** 6, "gibit": 1024 ** 3,
          "gbit": 10 ** 9, "tibit": 1024 ** 4, "tbit": 10 ** 12, "bps": 8, "kibps": 8 * 1024, "kbps": 8000,
          "mibps": 8 * 1024 ** 2, "mbps": 8 * 10 ** 6, "gibps": 8 * 1024 ** 3, "gbps": 8 * 10 ** 9,
          "tibps": 8 * 1024 ** 4, "tbps": 8 * 10 ** 12}
_RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE)
MIN_RATE_BPS = 8000


def parse_rate(text: str) -> int:
    """A rate as tc writes it (`100mbit`, `1gbit`, `1.5gbit`, `12MBps`; a bare number is bits/s), in bits/s.

    Raises:
        ValueError: not a rate, an unknown unit, or under 8kbit.
    """
    m = _RATE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or (unit and unit not in _UNITS):
        raise ValueError(f"{text!r} is not a rate: a number and one of tc's units, e.g. 100mbit, 1gbit, 10gbit "
                         f"(units: {', '.join(_UNITS)})")
    bps = int(round(float(m.group(1)) * _UNITS[unit or "bit"]))
    if bps < MIN_RATE_BPS:
        raise ValueError(f"{text!r} is {bps} bit/s; a ps link needs at least {MIN_RATE_BPS // 1000}kbit")
    return bps


def format_rate(bps: int) -> str:
    """`100mbit`, `1gbit`, `1.5gbit`, `64kbit`: the largest decimal unit that keeps a short number."""
    for unit, scale in (("tbit", 10 ** 12), ("gbit", 10 ** 9), ("mbit", 10 ** 6), ("kbit", 1000)):
        if bps >= scale:
            return f"{bps / scale:.4g}{unit}"
    return f"{bps}bit"


def format_bytes(n: int) -> str:
    """Bytes in decimal MB (or kB under one MB), as link rates are decimal."""
    return f"{n / 1e6:.1f} MB" if n >= 10 ** 6 else f"{n / 1e3:.1f} kB"


@dataclass(frozen=True)
class LinkShaping:
    """Each port in `ports` (one per ps task, in index order) limited to `rate_bps` per direction on `dev`; what
    leaves `worker_ports` (the gradients the ps pull) to `rate_bps` x len(ports), pooled."""

    rate_bps: int
    ports: tuple[int, ...]
    worker_ports: tuple[int, ...] = ()
    dev: str = "lo"

    def __post_init__(self) -> None:
        if self.rate_bps < MIN_RATE_BPS:
            raise ValueError(f"rate_bps must be at least {MIN_RATE_BPS}, got {self.rate_bps}")
        every = self.ports + self.worker_ports
        if not self.ports or len(set(every)) != len(every) or not all(0 < p < 65536 for p in every):
            raise ValueError(f"ports must be distinct TCP ports, at least one ps; got ps {self.ports}, workers "
                             f"{self.worker_ports}")

    def classes(self, index: int) -> tuple[str, str]:
        """The classids of ps `index`: (to its port, from its port)."""
        minor = _FIRST_MINOR + 2 * index
        return f"1:{minor:x}", f"1:{minor + 1:x}"

    def describe(self) -> str:
        """One line for the start banner."""
        ports = ", ".join(f"ps:{i} port {p}" for i, p in enumerate(self.ports))
        pulled = (f"; gradients pulled from the workers' ports pooled at "
                  f"{format_rate(self.rate_bps * len(self.ports))}" if self.worker_ports else "")
        return (f"each ps link shaped to {format_rate(self.rate_bps)} per direction on {self.dev} (tc htb: "
                f"{ports}{pulled}; other traffic unshaped)")


def _class_argv(dev: str, classid: str, bps: int) -> list[str]:
    burst = f"{max(_MIN_BURST_BYTES, int(bps / 8 * _BURST_SECS))}b"
    return [TC, "class", "add", "dev", dev, "parent", HANDLE, "classid", classid, "htb", "rate", f"{bps}bit",
            "ceil", f"{bps}bit", "burst", burst, "cburst", burst, "quantum", "60000"]


def _filter_argv(dev: str, direction: str, port: int, classid: str) -> list[str]:
    return [TC, "filter", "add", "dev", dev, "parent", HANDLE, "protocol", "ip", "prio", "1", "u32",
            "match", "ip", direction, str(port), "0xffff", "flowid", classid]


def setup_argvs(shaping: LinkShaping) -> list[list[str]]:
    """The tc commands, in order, that install `shaping` on a device with no qdisc of ours yet."""
    dev = shaping.dev
    argvs = [[TC, "qdisc", "add", "dev", dev, "root", "handle", HANDLE, "htb", "default",
              DEFAULT_CLASS.split(":")[1]],
             _class_argv(dev, DEFAULT_CLASS, FAST_RATE_BPS)]
    for i, port in enumerate(shaping.ports):
        to_port, from_port = shaping.classes(i)
        argvs += [_class_argv(dev, to_port, shaping.rate_bps), _class_argv(dev, from_port, shaping.rate_bps),
                  _filter_argv(dev, "dport", port, to_port), _filter_argv(dev, "sport", port, from_port)]
    if shaping.worker_ports:
        argvs.append(_class_argv(dev, PULLED_CLASS, shaping.rate_bps * len(shaping.ports)))
        argvs += [_filter_argv(dev, "sport", port, PULLED_CLASS) for port in shaping.worker_ports]
    return argvs


_CLASS_LINE = re.compile(r"^class htb (\S+) .*?\n\s*Sent (\d+) bytes", re.MULTILINE)


def parse_class_bytes(tc_output: str) -> dict[str, int]:
    """Bytes sent per HTB classid, from `tc -s class show dev DEV`."""
    return {classid: int(sent) for classid, sent in _CLASS_LINE.findall(tc_output)}


@dataclass(frozen=True)
class PortBytes:
    """What one ps link carried: bytes to the ps's port and bytes from it."""

    to_ps: int
    from_ps: int


def port_bytes(shaping: LinkShaping, counters: Mapping[str, int]) -> list[PortBytes]:
    """Per ps (index order), the bytes its two classes sent, from `parse_class_bytes`'s counters. With one ps,
    `to_ps` includes what it pulled from the workers' ports (the pooled class is all its own)."""
    pulled = counters.get(PULLED_CLASS, 0) if len(shaping.ports) == 1 else 0
    out = [PortBytes(*(counters.get(c, 0) for c in shaping.classes(i))) for i in range(len(shaping.ports))]
    return [PortBytes(b.to_ps + pulled, b.from_ps) for b in out]


def report_lines(shaping: LinkShaping, counters: Mapping[str, int]) -> list[str]:
    """The final report's lines: bytes each way through each ps link (and, with several ps, the gradients they
    pulled from the workers, together)."""
    rate = format_rate(shaping.rate_bps)
    lines = [f"ps:{i} link ({rate} each way): {format_bytes(b.to_ps)} to it, {format_bytes(b.from_ps)} from it"
             for i, b in enumerate(port_bytes(shaping, counters))]
    if len(shaping.ports) > 1 and shaping.worker_ports:
        lines.append(f"ps links ({len(shaping.ports)} x {rate} pooled): "
                     f"{format_bytes(counters.get(PULLED_CLASS, 0))} of gradients pulled from the workers, "
                     "in addition to the 'to it' above")
    return lines


# -- running tc (the only side effects) ----------------------------------------------------------------------------

Runner = Callable[..., subprocess.CompletedProcess]


def missing_tool() -> Optional[str]:
    """None if `tc` is on PATH, else what is missing, in words."""
    return None if shutil.which(TC) else "the 'tc' command (iproute2) on PATH"


def _tc(argv: Sequence[str], run: Runner) -> str:
    done = run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def install(shaping: LinkShaping, run: Runner = subprocess.run) -> None:
    """Runs `setup_argvs(shaping)` (needs CAP_NET_ADMIN: root in this network namespace).

    Raises:
        RuntimeError: a tc command failed; the message has its argv and stderr.
    """
    for argv in setup_argvs(shaping):
        _tc(argv, run)


def read_counters(dev: str = "lo", run: Runner = subprocess.run) -> dict[str, int]:
    """Bytes sent per HTB class on `dev` so far (`tc -s class show dev DEV`)."""
    return parse_class_bytes(_tc([TC, "-s", "class", "show", "dev", dev], run))


def class_bytes(shaping: LinkShaping, run: Runner = subprocess.run) -> list[PortBytes]:
    """Per ps, the bytes its link has carried each way so far."""
    return port_bytes(shaping, read_counters(shaping.dev, run))
