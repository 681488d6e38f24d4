"""Which peer stopped answering: one short gRPC probe of each task, all at once, each bounded.

A worker whose step is slow or timed out probes the tasks the step talks to (its ps tasks; the in-graph client's
workers as well) to say which one is at fault: a task that answers, one whose port refuses connections (its process
is gone), and one that does not answer at all (a network partition, a hung host or process). A TCP connect alone
cannot tell the last from a live task: a stopped process's kernel still accepts connections; its gRPC server does
not answer them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from psworker.task.server import PROBE_CHANNEL_OPTIONS, PROBE_METHOD

ANSWERED = "answered"
REFUSED = "refused"       # the connection was refused or reset: nothing serves at that port
SILENT = "silent"         # no answer within the probe's timeout
PROBE_SECS = 1.0          # one probe (a live task answers in a few ms, also on a loaded host)


@dataclass(frozen=True)
class Probed:
    """What one probe of task `name` at `address` found (`state`: ANSWERED, REFUSED or SILENT)."""

    name: str
    address: str
    state: str


def probe(address: str, timeout: float = PROBE_SECS) -> str:
    """ANSWERED, REFUSED or SILENT: one call of a method no server implements (a gRPC server answers
    UNIMPLEMENTED), on a channel of its own."""
    import grpc

    channel = grpc.insecure_channel(address, options=PROBE_CHANNEL_OPTIONS)
    try:
        channel.unary_unary(PROBE_METHOD)(b"", timeout=timeout, wait_for_ready=False)
        return ANSWERED
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return SILENT
        return REFUSED if code == grpc.StatusCode.UNAVAILABLE else ANSWERED
    finally:
        channel.close()


def probe_all(tasks: Mapping[str, str], timeout: float = PROBE_SECS,
              probe_one: Callable[[str, float], str] = probe) -> list[Probed]:
    """Probes every task of `{name: "host:port"}` at once (a thread each); returns in `tasks`' order after at most
    about `timeout` seconds. A probe still running then (it should not: each has its own deadline) counts as
    SILENT."""
    found: dict[str, str] = {}

    def run(name: str, address: str) -> None:
        found[name] = probe_one(address, timeout)

    threads = [threading.Thread(target=run, args=item, name=f"psworker-probe-{item[0]}", daemon=True)
               for item in tasks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return [Probed(name, address, found.get(name, SILENT)) for name, address in tasks.items()]


def at_fault(probed: list[Probed]) -> list[Probed]:
    """The probed tasks that did not answer (silent or refused)."""
    return [p for p in probed if p.state != ANSWERED]


def describe(probed: list[Probed], waited_secs: Optional[float] = None) -> str:
    """What the probes found, for a message: `ps:1 at 127.0.0.1:2223 did not answer for 60 s`, `ps:0 at ... refused
    the connection (is it running?)`; or, when every task answered, that they did (`ps:0, ps:1 answered a probe`)."""
    bad = at_fault(probed)
    if not bad:
        return f"{', '.join(p.name for p in probed)} answered a probe" if probed else ""
    waited = "" if waited_secs is None else f" for {waited_secs:.0f} s"
    parts = [f"{p.name} at {p.address} did not answer{waited}" if p.state == SILENT
             else f"{p.name} at {p.address} refused the connection (is it running?)" for p in bad]
    return "; ".join(parts)


__all__ = ["ANSWERED", "REFUSED", "SILENT", "PROBE_SECS", "Probed", "probe", "probe_all", "at_fault", "describe"]
