"""More steps in flight on one async worker (`--concurrent_steps`): the rules, a real cluster training criteo with
two steps in flight (it learns, the helpers step, every example is dealt once), and a ps killed under them (the
helpers wait for the recovered session and go on; nothing is lost beyond the newest checkpoint)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from psworker.data import criteo_synthetic
from psworker.errors import SpecError
from psworker.spec import TrainConfig, merge_train
from psworker.testing import assert_processes_gone, checkpoint_step, console_steps, write_spec
from tests.cluster_utils import REPO, run_launcher, task_env

AUC = re.compile(r"auc = ([0-9.]+), logloss")
DONE = re.compile(r"\[(worker:\d)\] last step done \((\d+) local steps, (\d+) of them by the helpers\)")
DATA = re.compile(r"data: (?:epoch [0-9.]+: )?(\d+) examples trained, (\d+) of them (?:dealt )?again")
SAVED = re.compile(r"checkpoint of global step (\d+) saved")
RESTORED = re.compile(r"restoring the checkpoint model\.ckpt-(\d+)")


def test_more_steps_in_flight_are_refused_in_sync_mode_with_staging_and_in_graph():
    with pytest.raises(SpecError, match=r"--concurrent_steps: more than one step in flight is for async mode only"):
        merge_train(TrainConfig(mode="sync"), {"concurrent_steps": "2"})
    with pytest.raises(SpecError, match=r"--concurrent_steps: staged variables hold one step's values"):
        merge_train(TrainConfig(staged_vars=True), {"concurrent_steps": "2"})
    with pytest.raises(SpecError, match=r"--concurrent_steps: concurrent_steps is for between-graph"):
        merge_train(TrainConfig(replication="in-graph"), {"concurrent_steps": "3"})
    with pytest.raises(SpecError, match=r"--concurrent_steps"):
        merge_train(TrainConfig(), {"concurrent_steps": "0"})
    assert merge_train(TrainConfig(mode="sync"), {"concurrent_steps": "1"}).concurrent_steps == 1


def test_the_command_line_refuses_two_steps_in_flight_in_sync_mode_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "psworker", "local", str(REPO / "cluster_specs" / "local-sync.yaml"),
                           "--concurrent_steps", "2", "--train_dir", str(tmp_path / "t")], env=task_env(),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--concurrent_steps: more than one step in flight is for async mode only" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "t").exists()


@pytest.fixture(scope="module")
def criteo_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("criteo")
    criteo_synthetic.write_synthetic(str(folder), days=3, rows_per_day=4000, compress=True, seed=0)
    return folder


@pytest.mark.slow
def test_two_steps_in_flight_train_criteo_and_deal_every_example_once(criteo_dir, tmp_path):
    """1 ps + 1 worker, two steps in flight, packed: the helper steps too, the held-out AUC shows the planted
    signal learned, the run ends exactly at max_steps (each step claims its global step: `step_claim`), the local
    steps are the global steps (an unclaimed step counts none), and the examples trained are exactly the global
    steps' batches, none dealt again."""
    steps, batch = 400, 64
    spec = write_spec(tmp_path / "criteo.yaml", num_ps=1, num_workers=1, model="criteo", batch_size=batch)
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "train"), "--data_dir", str(criteo_dir),
                        "--max_steps", str(steps), "--concurrent_steps", "2", "--pack_transfers", "true"],
                       cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert "[worker:0] 2 steps in flight (1 helper thread beside the step loop)" in run.output
    done = DONE.search(run.output)
    assert done and int(done[3]) > 0 and int(done[2]) > int(done[3]), run.output[-3000:]
    final = checkpoint_step(tmp_path / "train")
    assert final == steps, final
    assert int(done[2]) == final, (done[0], final)   # one worker: its steps are every global step
    auc = AUC.search(run.output)
    assert auc and float(auc[1]) >= 0.7, run.output[-3000:]
    data = DATA.search(run.output)
    assert data and (int(data[1]), int(data[2])) == (final * batch, 0), (data and data[0], final)
    assert_processes_gone(run.pids)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_ps_killed_under_two_steps_in_flight_loses_nothing_past_the_newest_checkpoint(tmp_path):
    """1 ps + 2 workers of the MLP, two steps in flight each; the ps is killed at step 150 and restarted: every
    worker's helper fails, and the chief's waits for the recovered session and steps again; the run ends, every task
    exits 0, the chief restored the newest checkpoint it had saved, and no step line fell below it."""
    train_dir = tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", max_steps=300, batch_size=32, log_every_steps=10,
                      save_checkpoint_steps=100, train_dir=str(train_dir), step_timeout_secs=120.0)
    run = run_launcher([str(spec), "--max_restarts", "2", "--restart_backoff_secs", "0.5", "--inject",
                        "kill:ps:0@step=150", "--console", "plain", "--concurrent_steps", "2"], cwd=tmp_path, timeout=360)
    out = run.output
    assert run.returncode == 0, out[-4000:]
    assert "restart 1: injected kill:ps:0@step=150" in out
    assert checkpoint_step(train_dir) >= 300
    # worker:1 may come back only once the chief has finished; the chief trains on from the checkpoint
    assert "a helper's step failed" in (train_dir / "logs" / "worker-1.log").read_text()
    chief = (train_dir / "logs" / "worker-0.log").read_text()
    failed, resumed = chief.find("a helper's step failed"), chief.find("a helper's steps go on after a failed one")
    assert 0 <= failed < resumed, chief[-3000:]
    restored = RESTORED.search(chief)
    assert restored, chief[-3000:]
    newest = max(int(s) for s in SAVED.findall(chief[:restored.start()]))
    assert int(restored[1]) == newest, chief[-3000:]
    highest: dict[str, int] = {}
    for task, step in console_steps(out):
        if step < highest.get(task, step):
            assert step >= newest, (task, step, newest)
        highest[task] = max(highest.get(task, step), step)
    assert_processes_gone(run.pids)


def _counter_graph():
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        step = v1.train.get_or_create_global_step()
        train_op = v1.assign_add(step, 1).op
        init = v1.global_variables_initializer()
    return graph, step, train_op, init


def test_helpers_step_only_after_the_loop_and_come_back_after_a_failed_session():
    """In one process, real sessions: the helper waits for the loop's first step; steps on the session the loop
    last stepped on; when that session is closed under it, it waits until the loop steps on a new one, then goes on;
    it ends by itself at the last step."""
    import tensorflow as tf

    from psworker.task.extra_steps import ExtraSteps

    v1 = tf.compat.v1
    graph, step, train_op, init = _counter_graph()
    first, second = v1.Session(graph=graph), v1.Session(graph=graph)
    for sess in (first, second):
        sess.run(init)
    extra = ExtraSteps(1, train_op, None, "worker:0", join_secs=30, global_step=step, last_step=10 ** 9)
    with extra:
        assert first.run(step) == 0 and extra.steps == 0   # nothing before the loop's first step
        first.run(train_op)
        extra.stepped(first)
        _wait(lambda: extra.steps >= 5, "the helper stepping on the first session")
        first.close()
        _wait(lambda: extra.failures >= 1, "the helper failing on the closed session")
        done = extra.steps
        second.run(train_op)
        extra.stepped(second)
        _wait(lambda: second.run(step) > 50, "the helper stepping on the second session")
    assert extra.steps > done and extra.failures == 1
    ended = ExtraSteps(1, train_op, None, "worker:0", join_secs=30, global_step=step, last_step=200)
    with ended:
        ended.stepped(second)
        _wait(lambda: not ended._threads[0].is_alive(), "the helper ending at the last step")
    assert 199 <= second.run(step) <= 200


def test_a_helper_counts_only_the_steps_that_claimed_a_global_step():
    """In one process: steps claim their global step below 20 (`step_claim.claim_step`, the claim of two steps in
    flight); the loop steps once, then a helper steps on, past 20. The global step ends at exactly 20, and the
    helper counts 19 steps however many it ran (`runs` counts every run, claimed or not)."""
    import tensorflow as tf

    from psworker.task.extra_steps import ExtraSteps
    from psworker.train.step_claim import claim_step

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        step = v1.train.get_or_create_global_step()
        runs = v1.Variable(0, dtype=tf.int64, name="runs", use_resource=True)
        claimed = claim_step(step, 20)
        train_op = tf.group(claimed, runs.assign_add(1))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    extra = ExtraSteps(1, train_op, None, "worker:0", join_secs=30, global_step=step, last_step=10 ** 9,
                       claimed=claimed)
    with extra:
        assert sess.run([train_op, claimed])[1]
        extra.stepped(sess)
        _wait(lambda: sess.run(runs) >= 40, "the helper stepping past the last claim")
    assert (sess.run(step), extra.steps) == (20, 19)


def _wait(condition, what: str, secs: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + secs
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {secs} s waiting for {what}"
        time.sleep(0.01)
