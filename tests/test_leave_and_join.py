"""An elastic job's workers join and leave a running cluster by themselves (issue 18, the task side): a worker started
late joins and trains at once; SIGUSR2 (scaled away) ends it with 0 after its step, SIGTERM (preempted) with 171; the
ps counts only the chief and the workers that joined and have not left, so none of them holds it up, and a preempted
worker started again joins again. Tasks started by hand (`LocalCluster`), as a scheduler would; the launcher's side is
tested in the launcher's own tests."""

from __future__ import annotations

import dataclasses
import re
import signal

import pytest

from psworker.errors import EXIT_PREEMPTED
from psworker.spec import Elastic, dump_spec, load_spec
from psworker.testing import STEP_LINE, LocalCluster, assert_processes_gone, checkpoint_step, write_spec

pytestmark = pytest.mark.slow

JOINED = re.escape("joined the job (told every ps)")


def elastic_cluster(tmp_path, max_steps: int) -> LocalCluster:
    path = write_spec(tmp_path / "fixed.yaml", num_workers=3, batch_size=32, log_every_steps=25,
                      max_steps=max_steps, step_timeout_secs=120.0, train_dir=str(tmp_path / "train"))
    spec = dataclasses.replace(load_spec(path), elastic=Elastic(min=1, start=2, max=3))
    (tmp_path / "elastic.yaml").write_text(dump_spec(spec))
    return LocalCluster(tmp_path, tmp_path / "elastic.yaml", start=False)


def hold(cluster: LocalCluster, *names: str) -> None:
    for name in names:
        cluster.send_signal(name, signal.SIGSTOP)


def go_on(cluster: LocalCluster, *names: str) -> None:
    for name in names:
        cluster.send_signal(name, signal.SIGCONT)


def test_workers_join_leave_and_come_back_without_holding_the_ps(tmp_path):
    """Every change happens while the other workers are held (SIGSTOP), so that training cannot end before it. The
    test holds them from their own logs, within a few steps of the lines it waits for (worker:1's second step line
    is at step 50): max_steps 1,000 leaves 10x that margin, and the steps after the last change are the run's tail."""
    max_steps = 1000
    with elastic_cluster(tmp_path, max_steps) as cluster:
        cluster.start("ps:0", "worker:0", "worker:1")
        cluster.wait_for_log("worker:1", STEP_LINE, 240, count=2)

        hold(cluster, "worker:0", "worker:1")              # a late worker joins and trains at once
        cluster.start("worker:2")
        cluster.wait_for_log("worker:2", JOINED, 240)
        cluster.wait_for_log("worker:2", STEP_LINE, 120)
        hold(cluster, "worker:2")
        cluster.wait_for_log("ps:0", r"worker:2 joined the job \(members now: worker:0, worker:1, worker:2\)", 60)

        go_on(cluster, "worker:1")                         # scaled away: its step, a word to the ps, exit 0
        cluster.send_signal("worker:1", signal.SIGUSR2)
        assert cluster.wait_exit("worker:1", 120) == 0, cluster.tail("worker:1")
        assert "worker:1: left the job (scaled away, SIGUSR2)" in cluster.log("worker:1")
        cluster.wait_for_log("ps:0", r"worker:1 left the job \(members now: worker:0, worker:2\)", 60)

        cluster.send_signal("worker:2", signal.SIGTERM)    # preempted while held: it leaves once it goes on
        go_on(cluster, "worker:2")
        assert cluster.wait_exit("worker:2", 120) == EXIT_PREEMPTED, cluster.tail("worker:2")
        assert "worker:2: left the job (preempted, SIGTERM)" in cluster.log("worker:2")
        cluster.wait_for_log("ps:0", r"worker:2 left the job \(members now: worker:0\)$", 60)

        cluster.restart("worker:2")                        # comes back at the same address and joins again
        cluster.wait_for_log("worker:2", JOINED, 240, current=True)
        cluster.wait_for_log("worker:2", STEP_LINE, 120, current=True)
        go_on(cluster, "worker:0")
        codes = cluster.wait_exits(240, ["worker:0", "worker:2", "ps:0"])
        assert codes == {"worker:0": 0, "worker:2": 0, "ps:0": 0}, (codes, cluster.tails())
        ps = cluster.log("ps:0")
        assert "has gone away after training ended" not in ps, ps[-3000:]   # nobody held it up
        assert "ps:0: every worker is done; exiting" in ps
        assert re.search(r"worker:\d is done \(2 of 2\)", ps), ps[-3000:]   # the members, not the spec's 3
        assert checkpoint_step(cluster.train_dir) >= max_steps
        assert "precision @ 1 = " in cluster.log("worker:0")
    assert_processes_gone(cluster.pids)
