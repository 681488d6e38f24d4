"""A stop saves (issue 36): SIGINT or SIGTERM to the launcher ends the workers after their running step, the chief
writes a checkpoint while the ps tasks serve on, the launcher's last line names its step, and the same command goes on
from it: no step lost in async, at most the running step in sync. A second SIGINT stops at once. Started by hand
(the start scripts), a ps that gets SIGTERM serves until the chief has saved and exited; a second SIGTERM ends it.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from psworker import environment, events
from psworker.launcher.console.stopline import newest_checkpoint_step
from psworker.testing import STEP_LINE, assert_processes_gone
from tests.cluster_utils import REPO, launch_script, steps_lost

pytestmark = pytest.mark.slow

SPECS = {"async": REPO / "cluster_specs" / "local.yaml", "sync": REPO / "cluster_specs" / "local-sync.yaml"}
ENDLESS = "1000000"
STOP_LINE = r"^psworker: stopped; checkpoint of step ([\d,]+) saved in (.+); the same command goes on from it$"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig, mode", [(signal.SIGINT, "async"), (signal.SIGTERM, "sync")],
                         ids=["SIGINT-async", "SIGTERM-sync"])
def test_a_stop_saves_and_the_same_command_goes_on_from_it(launcher, tmp_path, sig, mode):
    train_dir = tmp_path / "t"
    args = [str(SPECS[mode]), "--train_dir", str(train_dir), "--log_every_steps", "20", "--console", "plain"]
    run = launcher(*args, "--max_steps", ENDLESS)
    run.wait_for(r"^\[worker:1\] step [1-9]\d*, loss", "worker:1 training")
    run.wait_for(r"^\[worker:0\] step [1-9]\d*, loss", "worker:0 training")
    asked = time.monotonic()
    assert run.end(sig) == 128 + sig, run.tail()
    took = time.monotonic() - asked
    assert_processes_gone(run.pids, timeout=30)
    lines = run.snapshot()
    assert re.match(STOP_LINE, lines[-1]), run.tail()      # the launcher's last line
    saved = int(re.match(STOP_LINE, lines[-1]).group(1).replace(",", ""))
    assert Path(re.match(STOP_LINE, lines[-1]).group(2)) == train_dir
    assert newest_checkpoint_step(train_dir) == saved
    lost = steps_lost(train_dir / "logs", saved)
    print(f"stop/resume: {signal.Signals(sig).name}, local, {mode}: checkpoint of step {saved}, {lost} steps lost, "
          f"the stop took {took:.1f} s")
    assert lost == 0 if mode == "async" else lost <= 1, (lost, saved)
    assert run.find(r"\[ps:0\] warning: stopped on SIG[A-Z]+: worker:0 \(the chief\) has exited"), run.tail()
    assert not run.find(r"sending SIGKILL"), run.tail()
    for log in (train_dir / "logs").glob("*.log"):      # a person's stop is no failure: no stacks asked for
        assert "--- stacks of" not in log.read_text(), log

    again = launcher(*args, "--max_steps", str(saved + 30))
    assert again.wait_exit() == 0, again.tail()
    chief = events.current_attempt((train_dir / "logs" / "worker-0.log").read_text())
    assert f"restoring the checkpoint model.ckpt-{saved}\n" in chief, chief[-3000:]
    first = events.last(events.FirstStep, chief)     # the global step read with its first step: where it went on
    assert first is not None and first.step >= saved, chief[-3000:]
    assert_processes_gone(again.pids, timeout=30)


SLOW_TO_STOP = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(600)")


@pytest.mark.timeout(180)
def test_a_second_sigint_stops_at_once(launcher, tmp_path):
    """Workers that do not exit on SIGTERM hold the first stop up to its bound (here 300 s); a second SIGINT ends
    every task at once."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("cluster:\n  ps: ['localhost:auto']\n  worker: ['localhost:auto', 'localhost:auto']\n")
    run = launcher(str(spec), "--grace_period_secs", "300", "--console", "plain", "--", sys.executable, "-c", SLOW_TO_STOP,
                   command="run")
    run.wait_until(lambda: len([line for line in run.snapshot() if line.endswith("] ready")]) >= 2
                   or run.find(r"^\[ps:0, worker:0-1\] ready") is not None, "every task ready")
    run.pids.update(run.task_pids().values())
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(r"stopping \(launcher received SIGINT\): SIGTERM to worker:0, worker:1 first", "the first stop")
    started = time.monotonic()
    assert run.end(signal.SIGINT, timeout=60) == 130, run.tail()
    assert time.monotonic() - started < 30, run.tail()
    assert_processes_gone(run.pids, timeout=10)
    assert run.find(r"sending SIGKILL"), run.tail()


def _by_hand(make_cluster):
    return make_cluster(num_workers=1, argv=launch_script,
                        train=dict(batch_size=32, log_every_steps=20, max_steps=int(ENDLESS), step_timeout_secs=60.0))


@pytest.mark.timeout(600)
def test_start_scripts_a_ps_serves_until_the_chief_saved_and_a_second_sigterm_ends_it(make_cluster):
    """As a scheduler or a person stops tasks started by hand: SIGTERM to the ps first (it serves on, the chief
    trains on), then to the chief (it saves and exits, then the ps exits). Started again by the same commands, the
    chief restores that checkpoint; a ps that gets SIGTERM twice exits at once."""
    cluster = _by_hand(make_cluster)
    cluster.wait_for_log("worker:0", STEP_LINE, 180, count=2)
    cluster.send_signal("ps:0", signal.SIGTERM)
    cluster.wait_for_log("ps:0", re.escape("got SIGTERM: serving until worker:0 (the chief) has exited"), 60)
    before = len(cluster.steps("worker:0"))
    cluster.wait_for_log("worker:0", STEP_LINE, 60, count=before + 1)   # the chief trains on
    assert "ps:0" not in cluster.exit_codes()
    cluster.send_signal("worker:0", signal.SIGTERM)
    codes = cluster.wait_exits(120, ["worker:0", "ps:0"])
    assert codes == {"worker:0": 143, "ps:0": 143}, (codes, cluster.tails())
    saved = events.last(events.StopSaved, cluster.log("worker:0"))
    assert saved is not None and saved.signal == "SIGTERM", cluster.tail("worker:0")
    assert saved.step >= cluster.steps("worker:0")[-1] and newest_checkpoint_step(cluster.train_dir) == saved.step
    assert "worker:0 (the chief) has exited" in cluster.log("ps:0")

    cluster.restart("ps:0")
    cluster.restart("worker:0")
    cluster.wait_for_log("worker:0", STEP_LINE, 180, count=1, current=True)
    assert f"restoring the checkpoint model.ckpt-{saved.step}\n" in cluster.log("worker:0", current=True)
    cluster.send_signal("ps:0", signal.SIGTERM)
    cluster.wait_for_log("ps:0", "got SIGTERM: serving until worker:0", 60, current=True)
    cluster.send_signal("ps:0", signal.SIGTERM)
    assert cluster.wait_exit("ps:0", 30) == 143, cluster.tail("ps:0")
    assert "got SIGTERM again: exiting at once" in cluster.log("ps:0", current=True)
    cluster.close()
    assert_processes_gone(cluster.pids)


@pytest.mark.timeout(600)
def test_a_stopping_sync_chief_whose_step_waits_for_a_stopped_worker_saves_within_seconds(make_cluster):
    """The race of a sync stop: worker:1 stops after its step, and the chief's running step needed its next
    gradient. The stopping chief queues tokens after `PEERS_STOP_SECS`, writes the checkpoint of the last applied
    step and exits 143, instead of waiting out --step_timeout_secs; started again on the same ps, it trains on.

    Both waits of the race are the tasks' own, shortened from their 10 s defaults (`psworker.environment`): the
    slow-step warning that shows the chief's step blocked comes after 3 s (a sync step here takes 10-20 ms, ~0.4 s
    at worst under load, and the chief has done a step already), and the stopping chief queues its tokens 3 s
    after the signal (worker:1 has exited by then: nothing else is waited for). The 300 s step timeout stays far
    off, so only the stop can end the blocked step."""
    cluster = make_cluster(num_workers=2, argv=launch_script,
                           train=dict(mode="sync", batch_size=32, log_every_steps=5, max_steps=int(ENDLESS),
                                      step_timeout_secs=300.0),
                           env={environment.SLOW_STEP_ENV: "3", environment.PEERS_STOP_ENV: "3"})
    cluster.wait_for_log("worker:0", STEP_LINE, 180, count=1)
    cluster.send_signal("worker:1", signal.SIGTERM)
    assert cluster.wait_exit("worker:1", 60) == 143, cluster.tail("worker:1")
    cluster.wait_for_log("worker:0", "a training step has been running for", 60)    # blocked: 1 of 2 gradients
    asked = time.monotonic()
    cluster.send_signal("worker:0", signal.SIGTERM)
    code = cluster.wait_exit("worker:0", 120)    # the ps serves on: a stop is not the end of training
    took = time.monotonic() - asked
    assert code == 143, cluster.tails()
    assert "queueing one sync token per worker" in cluster.log("worker:0"), cluster.tail("worker:0")
    saved = events.last(events.StopSaved, cluster.log("worker:0"))
    assert saved is not None and newest_checkpoint_step(cluster.train_dir) == saved.step, cluster.tail("worker:0")
    assert saved.step >= cluster.steps("worker:0")[-1]
    assert took < 120, f"the chief's stop took {took:.0f} s"
    cluster.restart("worker:0")      # the ps served on: its sync state (tokens left over) must not block the chief
    cluster.restart("worker:1")
    cluster.wait_for_log("worker:0", STEP_LINE, 180, count=2, current=True)
    cluster.close()
    assert_processes_gone(cluster.pids)
