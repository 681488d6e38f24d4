"""The run policy as pure functions (`psworker.launcher.supervise.run_policy`): exits in, verdicts and the drain out, no
process started. The supervisor carrying them out is tested with real processes in test_supervisor.py,
test_success_policy.py and test_restart_policy.py."""

from __future__ import annotations

import json
import signal

from psworker.launcher.supervise import run_policy as rp
from psworker.launcher.elastic import membership as ms
from psworker.launcher.policy import RestartPolicy
from psworker.launcher.console.progress import TaskProgress
from psworker.states import TaskState

WORKERS = frozenset({"worker"})


def task(name: str, returncode=None, **kw) -> rp.TaskView:
    job, index = name.split(":")
    return rp.TaskView(name, job, is_chief=kw.pop("is_chief", name == "worker:0"), returncode=returncode, **kw)


def test_task_states_keep_their_text_in_json_and_the_view():
    assert json.dumps({"state": TaskState.NOT_STARTED}) == '{"state": "not started"}'
    assert f"{TaskState.PAUSED}" == "stopped (injected)" and TaskState("left") is TaskState.LEFT
    assert TaskProgress("worker:1", TaskState.RESTARTING, restarts=1).label == "restarting 2"
    assert TaskProgress("worker:1", TaskState.DONE).label == "done"
    assert [s for s in TaskState if s.active] == [TaskState.STARTING, TaskState.RUNNING, TaskState.TRAINING]
    assert not any(s.live for s in (TaskState.DONE, TaskState.FAILED, TaskState.NOT_STARTED, TaskState.RESERVED,
                                    TaskState.LEFT))


def test_the_deciding_task_alone_decides_success():
    rules = rp.Rules(WORKERS, deciding="worker:0")
    assert rp.succeeded([task("worker:0", 0), task("worker:1")], rules)
    assert not rp.succeeded([task("worker:0", 3), task("worker:1", 0)], rules)


def test_all_workers_counts_only_the_members():
    rules = rp.Rules(WORKERS)
    running = [task("ps:0"), task("worker:0", 0), task("worker:1")]
    assert not rp.succeeded(running, rules)
    left = [task("ps:0"), task("worker:0", 0), task("worker:1", counts=False)]
    assert rp.succeeded(left, rules)


def test_training_is_over_once_the_chief_and_every_ps_exited_0():
    assert rp.training_over([task("ps:0", 0), task("worker:0", 0), task("worker:1")])
    assert not rp.training_over([task("ps:0", 0), task("worker:0"), task("worker:1", 0)])
    assert not rp.training_over([task("ps:0", 0, stopped=True), task("worker:0", 0)])
    assert not rp.training_over([task("worker:0", 0)])          # no server: success decides alone


def test_which_exits_fail_the_run():
    rules = rp.Rules(WORKERS)
    assert rp.judge(task("worker:1", 0), rules, done=False) is None
    assert rp.judge(task("worker:1", 3), rules, done=False) == "exited with exit code 3"
    assert rp.judge(task("worker:1", -9, cause="stalled"), rules, done=False) == "ended (stalled)"
    assert rp.judge(task("ps:0", 0), rules, done=False) == "exited (exit code 0) while workers were still running"
    assert rp.judge(task("ps:0", 1), rules, done=True) is None
    assert rp.judge(task("evaluator:0", 0), rules, done=False) is None


def test_a_failure_is_restarted_after_the_rules_backoff():
    rules = rp.Rules(WORKERS, restart=RestartPolicy(max_restarts=1, backoff_secs=2.0, jitter=0.0))
    killed = task("worker:1", -signal.SIGKILL)
    assert rp.verdict(killed, rules, done=False, over=False) == rp.Restart(2.0, "killed by SIGKILL",
                                                                            "exited with killed by SIGKILL")
    again = task("worker:1", -signal.SIGKILL, restarts=1)
    assert rp.verdict(again, rules, done=False, over=False) == rp.Fail("exited with killed by SIGKILL")
    assert rp.verdict(task("worker:1", 2), rules, done=False, over=False) == rp.Fail("exited with exit code 2")


def test_exits_that_settle():
    rules = rp.Rules(WORKERS)
    assert rp.verdict(task("worker:1", 0), rules, False, False) == rp.Settled(TaskState.DONE)
    late = rp.verdict(task("ps:0", 1), rules, done=True, over=False)
    assert late == rp.Settled(TaskState.EXITED, "exited with exit code 1 after the run was done")
    assert rp.verdict(task("worker:1", 1), rules, done=True, over=True) == rp.Settled(TaskState.EXITED)


def test_membership_goes_first():
    rules = rp.Rules(WORKERS, restart=RestartPolicy(max_restarts=3))
    preempted = task("worker:2", 171)
    assert rp.verdict(preempted, rules, False, False, ms.MEMBER_LEFT) == rp.Settled(None)
    below = ms.MemberExit(left=True, failure="below min")
    assert rp.verdict(preempted, rules, False, False, below) == rp.Fail("below min")
    assert isinstance(rp.verdict(preempted, rules, False, False, ms.STILL_MEMBER), rp.Restart)


def test_after_success_the_workers_get_their_grace_then_the_servers():
    rules = rp.Rules(WORKERS, deciding="worker:0", worker_grace=40.0, ps_grace=15.0)
    straggling = [task("ps:0"), task("worker:0", 0), task("worker:1")]
    ending, finish = rp.drain(straggling, rules, rp.Ending(), now=100.0)
    assert ending == rp.Ending(100.0, 140.0, None, "worker:0 exited 0") and not finish
    assert rp.drain(straggling, rules, ending, now=139.0) == (ending, False)
    assert rp.drain(straggling, rules, ending, now=140.0) == (ending, True)
    served = [task("ps:0"), task("worker:0", 0), task("worker:1", 0)]
    ending, finish = rp.drain(served, rules, ending, now=120.0)
    assert ending.servers_until == 135.0 and not finish
    assert rp.drain(served, rules, ending, now=135.0)[1]
    assert rp.drain([task("ps:0", 0), *served[1:]], rules, ending, now=121.0)[1]


def test_a_worker_waiting_for_its_restart_holds_the_drain_and_may_restart_in_the_grace():
    rules = rp.Rules(WORKERS, worker_grace=40.0)
    waiting = task("worker:1", -9, waiting=True)
    assert rp.stragglers([task("worker:0", 0), waiting], rules) == ("worker:1",)
    ending = rp.Ending(100.0, 140.0, None, "done")
    assert rp.may_restart(waiting, rules, rp.Ending(), now=0.0)
    assert rp.may_restart(waiting, rules, ending, now=139.0) and not rp.may_restart(waiting, rules, ending, 140.0)
    assert not rp.may_restart(task("ps:0", -9, waiting=True), rules, ending, now=101.0)


def test_training_over_ends_the_run_with_no_grace():
    ending = rp.start_ending(rp.Ending(), now=50.0)
    assert ending == rp.Ending(50.0, 50.0, None, rp.OVER_REASON)
    assert rp.start_ending(ending, now=60.0) is ending
    rules = rp.Rules(WORKERS, worker_grace=40.0)
    assert rp.drain([task("ps:0", 0), task("worker:0", 0), task("worker:1")], rules, ending, now=50.0)[1]
