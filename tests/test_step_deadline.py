"""Every wait on a ps is bounded and says which ps (issue 24): the probes that tell a silent ps from a refused and
a live one (real gRPC server, closed port, a listener that never answers), and the step watchdog's deadline behind
TensorFlow's (a fake clock, then its real thread). The partition itself, in a real namespace: test_partition.py."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent import futures

import grpc
import pytest

from psworker.task import probe
from psworker.train.hooks import StepWatchdog


@pytest.fixture
def peers():
    """`{name: address}` of three peers: a gRPC server (answers), a closed port (refuses), and a socket that
    listens but never speaks (the kernel completes the connection; nothing answers: a hung or cut-off peer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    live = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    try:
        yield {"ps:0": f"127.0.0.1:{live}", "ps:1": f"127.0.0.1:{mute.getsockname()[1]}",
               "ps:2": f"127.0.0.1:{closed}"}
    finally:
        mute.close()
        server.stop(0)


def test_probe_tells_a_live_a_silent_and_a_refusing_peer_apart(peers):
    assert probe.probe(peers["ps:0"], 2.0) == probe.ANSWERED
    assert probe.probe(peers["ps:1"], 0.5) == probe.SILENT
    assert probe.probe(peers["ps:2"], 2.0) == probe.REFUSED


def test_probe_all_keeps_the_order_and_describe_names_the_culprits(peers):
    found = probe.probe_all(peers, timeout=0.5)
    assert [(p.name, p.address, p.state) for p in found] == [
        ("ps:0", peers["ps:0"], probe.ANSWERED), ("ps:1", peers["ps:1"], probe.SILENT),
        ("ps:2", peers["ps:2"], probe.REFUSED)]
    assert [p.name for p in probe.at_fault(found)] == ["ps:1", "ps:2"]
    assert probe.describe(found, 60.4) == (f"ps:1 at {peers['ps:1']} did not answer for 60 s; "
                                           f"ps:2 at {peers['ps:2']} refused the connection (is it running?)")
    assert probe.describe(found[1:2]) == f"ps:1 at {peers['ps:1']} did not answer"
    assert probe.describe(found[:1], 5) == "ps:0 answered a probe"
    assert probe.describe([], 5) == ""


def test_watchdog_deadline_is_the_limit_plus_grace_and_a_recreated_session_extends_it():
    now = [0.0]
    dog = StepWatchdog("worker:0", "why?", after_secs=10, every_secs=10, clock=lambda: now[0], grace_secs=5)
    dog.step_started()                 # no limit: never overdue
    now[0] = 1000.0
    assert dog.overdue() is None
    dog.step_started(limit_secs=10)    # at 1000: overdue from 1015
    now[0] = 1014.9
    assert dog.overdue() is None
    now[0] = 1012.0
    dog.extend(30)                     # a session re-created at 1012: overdue from 1047
    dog.extend(1)                      # never shortens
    now[0] = 1046.0
    assert dog.overdue() is None
    now[0] = 1047.0
    assert dog.overdue() == pytest.approx(47.0)
    dog.step_finished()
    assert dog.overdue() is None and dog.running_for() is None
    dog.extend(100)                    # between steps: nothing to extend
    dog.step_started(limit_secs=2)
    now[0] = 1054.0
    assert dog.overdue() == pytest.approx(7.0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        self.got = threading.Event()

    def emit(self, record):
        self.messages.append(record.getMessage())
        self.got.set()


def test_watchdog_thread_names_the_culprit_in_its_warning_then_gives_up_past_the_deadline():
    """Its real thread: the warning carries `diagnose`'s answer (run in that thread, never the step loop's); a step
    past limit + grace makes it call `give_up` once, with the step's running time, and stop."""
    records = _Records()
    logging.getLogger("psworker.train.hooks").addHandler(records)
    gave_up: list[float] = []
    done = threading.Event()
    diagnosed: list[str] = []

    def diagnose(secs: float) -> str:
        diagnosed.append(threading.current_thread().name)
        return "ps:1 at 127.0.0.1:9 did not answer"

    def give_up(secs: float) -> None:
        gave_up.append(secs)
        done.set()

    try:
        with StepWatchdog("worker:0", "is a ps task overloaded or unreachable?", after_secs=0.2, every_secs=0.2,
                          diagnose=diagnose, give_up=give_up, grace_secs=0.3) as dog:
            dog.step_started(limit_secs=0.5)
            assert done.wait(30), records.messages
    finally:
        logging.getLogger("psworker.train.hooks").removeHandler(records)
    assert len(gave_up) == 1 and gave_up[0] >= 0.8, gave_up
    assert diagnosed and set(diagnosed) == {"psworker-step-watchdog"}, diagnosed
    assert any(m.startswith("worker:0: a training step has been running for ")
               and m.endswith("s; is a ps task overloaded or unreachable? (ps:1 at 127.0.0.1:9 did not answer)")
               for m in records.messages), records.messages
