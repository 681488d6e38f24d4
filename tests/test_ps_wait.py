"""A ps's end-of-training rules (`shutdown._PsWait`), over a fake clock and fake ports: the chief's final checkpoint is
never given up on silently, a non-chief that vanished gets a rejoin grace, and every wait ends in a decision."""

from __future__ import annotations

import pytest

from psworker.errors import PeerGone
from psworker.task import shutdown
from psworker.testing import write_spec
from psworker.spec import load_spec


class Ports:
    """Which workers' ports are open (all, at first), and a clock the test moves."""

    def __init__(self, n: int):
        self.up = {f"w{i}" for i in range(n)}
        self.now = 0.0
        self.addresses: dict[str, str] = {}

    def probe(self, address: str) -> bool:
        return self.addresses[address] in self.up

    def clock(self) -> float:
        return self.now


def make_wait(tmp_path, n: int = 2, *, gone: float = 300.0, grace: float = 30.0, complete=lambda s: None):
    spec = load_spec(write_spec(tmp_path / "c.yaml", num_workers=n, max_steps=100, train_dir=str(tmp_path)))
    ports = Ports(n)
    ports.addresses = {str(a): f"w{i}" for i, a in enumerate(spec.worker)}
    wait = shutdown._PsWait(spec, "ps:0", gone_timeout_secs=gone, rejoin_grace_secs=grace, complete=complete,
                            clock=ports.clock, probe=ports.probe)
    return wait, ports


def step(wait, ports, done: set[int], secs: float) -> bool:
    ports.now += secs
    wait.watch._next_probe = 0.0   # probe on every call: the fake clock jumps
    return wait(done)


def test_a_chief_that_vanished_is_waited_for_then_the_ps_fails(tmp_path, caplog):
    caplog.set_level("INFO")
    wait, ports = make_wait(tmp_path, gone=300.0, grace=30.0)
    step(wait, ports, set(), 1.0)
    ports.up.discard("w0")                       # the chief is killed
    done = {1}                                   # worker:1 trains on and says it is done
    assert not step(wait, ports, done, 1.0)
    assert not step(wait, ports, done, 250.0)    # far beyond the rejoin grace: still waiting for the chief
    assert done == {1}
    assert "its final checkpoint is outstanding; waiting 300 s for it to come back" in caplog.text
    with pytest.raises(PeerGone, match=r"ps:0: the chief \(worker:0 at \S+\) went away without saying it was done "
                                       r"\(its final checkpoint is outstanding\) and did not come back within 300 s "
                                       r"\(--workers_gone_timeout_secs\)"):
        step(wait, ports, done, 60.0)


def test_the_chief_wait_counts_from_the_end_of_training(tmp_path):
    """A chief gone long before the others finished still gets the whole timeout after the end."""
    wait, ports = make_wait(tmp_path, gone=300.0)
    step(wait, ports, set(), 1.0)
    ports.up.discard("w0")
    assert not step(wait, ports, set(), 1000.0)  # worker:1 still training (its port is open)
    assert not step(wait, ports, {1}, 1.0)       # now it is done
    assert not step(wait, ports, {1}, 290.0)
    with pytest.raises(PeerGone):
        step(wait, ports, {1}, 20.0)


def test_a_chief_that_comes_back_is_waited_for_again(tmp_path):
    wait, ports = make_wait(tmp_path, gone=300.0)
    step(wait, ports, set(), 1.0)
    ports.up.discard("w0")
    assert not step(wait, ports, {1}, 200.0)
    ports.up.add("w0")                           # restarted: it trains, evaluates, exports
    assert not step(wait, ports, {1}, 200.0)
    assert not step(wait, ports, {1}, 200.0)


def test_a_vanished_chief_with_training_complete_on_disk_ends_the_wait(tmp_path, caplog):
    caplog.set_level("INFO")
    wait, ports = make_wait(tmp_path, gone=300.0, complete=lambda s: 100)
    step(wait, ports, set(), 1.0)
    ports.up.discard("w0")
    assert not step(wait, ports, {1}, 1.0)       # training ended: the wait for the chief starts
    assert not step(wait, ports, {1}, 298.0)
    assert step(wait, ports, {1}, 2.0)
    assert wait.finished == 100
    assert "ps:0: no chief for 300 s, and the latest checkpoint in" in caplog.text


def test_a_non_chief_that_vanished_gets_the_rejoin_grace_then_counts_as_done(tmp_path, caplog):
    caplog.set_level("INFO")
    wait, ports = make_wait(tmp_path, n=3, grace=30.0)
    step(wait, ports, set(), 1.0)
    ports.up.discard("w2")
    assert not step(wait, ports, set(), 0.0)     # seen down from now on
    done = {0, 1}
    assert not step(wait, ports, done, 29.0) and done == {0, 1}
    assert not step(wait, ports, done, 2.0)
    assert done == {0, 1, 2}
    assert "ps:0: worker:2 has gone away after training ended; counting it as done" in caplog.text


def test_the_default_rejoin_grace_covers_a_restart_by_hand():
    assert shutdown.VANISHED_GRACE_SECS >= 30.0
