"""Elastic membership without processes (`psworker.launcher.elastic.membership`), then the supervisor's membership with
fake workers (tests/fake_tasks/elastic_worker.py: SIGUSR2 -> exit 0, SIGTERM -> exit 171) and the run-dir
protocol of `psworker scale` (`psworker.launcher.elastic.scale_inbox`) against a real supervisor."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import signal
import subprocess
import sys
import threading
from typing import Optional

import pytest

from tests.fake_tasks.fakes import fake, drive_until, task_state
from psworker.errors import EXIT_PREEMPTED, PsworkerError, UsageError
from psworker.launcher.elastic import membership as ms
from psworker.states import TaskState
from psworker.launcher.backends.local import LocalBackend
from psworker.launcher.backends.ssh.backend import SshOptions
from psworker.launcher.elastic.workers import PREEMPTED_CODES
from psworker.launcher.inject import parse_fault
from psworker.launcher.policy import RestartPolicy
from psworker.launcher.rundir import ELASTIC_FILE, read_elastic_state
from psworker.launcher.elastic.scale_inbox import ScaleInbox, request_scale
from psworker.launcher.supervise.supervisor import Supervisor
from psworker.spec.addresses import Address
from psworker.spec import Elastic

E = Elastic(min=1, start=2, max=4)


# -- membership, pure --------------------------------------------------------------------------------------

def test_launch_starts_start_workers_and_reserves_the_rest():
    m = ms.initial(E)
    assert m.indices(TaskState.JOINED) == (0, 1) and m.indices(TaskState.RESERVED) == (2, 3)
    assert (m.running, m.target) == (2, 2)
    assert ms.reconcile(m) == ((), ())


def test_scale_up_starts_the_lowest_free_and_down_asks_the_highest_never_worker_0():
    m = ms.request(ms.initial(E), 4)
    assert ms.reconcile(m) == ((2, 3), ())
    m = ms.initial(E).with_state(2, TaskState.JOINED).with_state(3, TaskState.JOINED)
    assert ms.reconcile(ms.request(m, 1)) == ((), (3, 2, 1))
    one = ms.initial(Elastic(min=1, start=1, max=2))
    assert ms.reconcile(ms.request(one, 1)) == ((), ())


def test_a_worker_that_left_starts_again_but_not_while_leaving():
    m = ms.initial(E).with_state(1, TaskState.LEAVING).with_target(2)
    assert ms.reconcile(m) == ((2,), ())              # worker 1 is still leaving: the next free one joins
    m = ms.initial(E).with_state(1, TaskState.LEFT).with_target(2)
    assert ms.reconcile(m) == ((1,), ())


def test_once_a_worker_is_done_nobody_joins():
    m = ms.initial(E).with_state(1, TaskState.DONE).with_target(3)
    assert ms.reconcile(m) == ((), ())


@pytest.mark.parametrize("workers", [0, 5])
def test_a_target_outside_the_range_names_the_range(workers):
    with pytest.raises(ValueError, match=r"outside the job's elastic range 1\.\.4"):
        ms.request(ms.initial(E), workers)


# -- the supervisor's membership, with fake workers ----------------------------------------------------------

@pytest.fixture
def elastic_run(tmp_path, make_supervisor):
    """Builds a supervisor of one fake ps and `max` fake elastic workers (worker 0 holds at step 3, the others step
    on, until the test lets them finish: touch `go`; `held={i: n}`: worker i also holds at step n until the test
    touches `gate(i)`); stops whatever is left at teardown."""
    go = tmp_path / "go"

    def gate(index: int):
        return tmp_path / f"go-{index}"

    def make(elastic: Elastic, *, held: Optional[dict] = None, **kwargs) -> Supervisor:
        held = held or {}
        tasks = [fake("ps", 0, "sleep_forever")]
        tasks += [fake("worker", 0, "elastic_worker", "--go", go, "--hold", 3, "--to", 5)]
        tasks += [fake("worker", i, "elastic_worker", "--until", go, "--to", 100000,
                       *(("--go", gate(i), "--hold", held[i]) if i in held else ())) for i in range(1, elastic.max)]
        return make_supervisor(tasks, elastic=elastic, **kwargs)

    make.go = go
    make.gate = gate
    return make


def stepping(sup: Supervisor, *names: str) -> None:
    for name in names:
        drive_until(sup, lambda: sup.progress.snapshot()[name].step is not None, 30, f"{name}'s first step line")


def test_scale_up_and_down_by_hand(elastic_run, caplog):
    caplog.set_level(logging.INFO, logger="psworker.launcher")
    sup = elastic_run(E)
    with sup:
        assert sorted(sup.pids()) == ["ps:0", "worker:0", "worker:1"]
        assert task_state(sup, "worker:3") == "reserved"
        stepping(sup, "worker:0", "worker:1")
        assert sup.scale(4) == "scale 2 -> 4 workers (by hand)"
        stepping(sup, "worker:2", "worker:3")
        drive_until(sup, lambda: "worker:3 joined at global step" in caplog.text, 30, "worker:3's join line")
        assert sup.members()["workers"] == 4
        sup.scale(1)
        drive_until(sup, lambda: sup.members()["left"] == [1, 2, 3], 30, "workers 1-3 to leave")
        assert sup.progress.workers() == (1, 1)
        for i in (1, 2, 3):
            assert f"worker:{i} left (scaled away)" in caplog.text
            assert "leaving after step" in sup.log_path(f"worker:{i}").read_text()
        elastic_run.go.touch()
        result = sup.wait(60)
    assert result.ok, result.reason
    assert {n: e.returncode for n, e in result.exits.items() if n.startswith("worker")} == {
        "worker:0": 0, "worker:1": 0, "worker:2": 0, "worker:3": 0}
    assert result.failure is None and not any(e.restarts for e in result.exits.values())


def test_reserved_and_left_workers_do_not_hold_up_all_workers_success(elastic_run):
    from psworker.launcher.policy import ALL_WORKERS, SuccessPolicy

    sup = elastic_run(Elastic(min=1, start=2, max=3), success=SuccessPolicy(ALL_WORKERS, 5.0))
    with sup:
        stepping(sup, "worker:1")
        sup.scale(1)
        drive_until(sup, lambda: sup.members()["left"] == [1], 30, "worker 1 to leave")
        elastic_run.go.touch()
        result = sup.wait(60)
    assert result.ok, result.reason
    assert "worker:2" not in result.exits               # never started


def test_a_preempted_worker_leaves_and_the_run_goes_on_until_below_min(elastic_run, caplog):
    faults = (parse_fault("preempt:worker:2@step=5"), parse_fault("preempt:worker:1@step=40"))
    # worker:1 holds at step 39 until worker:2 has left: under load the two sleep-paced workers' starts drift apart
    # by seconds, and worker:1 could reach step 40 first.
    sup = elastic_run(Elastic(min=2, start=3, max=3), faults=faults, held={1: 39})
    with sup:
        drive_until(sup, lambda: sup.members()["left"] == [2], 30, "worker:2 to be preempted")
        assert sup.result is None and sup.members()["target"] == 2
        elastic_run.gate(1).touch()
        result = sup.wait(60)
    assert not result.ok
    assert result.failure.name == "worker:1" and result.failure.returncode == EXIT_PREEMPTED
    assert "preempted (exit 171)" in result.failure.reason and "min of 2" in result.failure.reason
    # 171 from its handler; or, preempted before it set one (under load), the death by the signal: a preemption too
    assert result.exits["worker:2"].returncode in PREEMPTED_CODES


def test_a_preempted_worker_comes_back_with_restarts(elastic_run):
    sup = elastic_run(Elastic(min=1, start=2, max=2), faults=(parse_fault("preempt:worker:1@step=5"),),
                      restart_policy=RestartPolicy(max_restarts=1, backoff_secs=0.1, seed=1))
    with sup:
        drive_until(sup, lambda: "step 1," in sup.log_path("worker:1").read_text().partition("--- restart 1")[2],
                   30, "worker:1's steps after its restart")
        assert sup.members()["workers"] == 2
        elastic_run.go.touch()
        result = sup.wait(60)
    assert result.ok, result.reason
    assert "injected preempt:worker:1@step=5" in result.exits["worker:1"].restart_causes[0]


def test_preempt_in_a_fixed_job_is_a_failure_as_before(tmp_path):
    tasks = [fake("ps", 0, "sleep_forever"), fake("worker", 0, "elastic_worker", "--to", 100000)]
    with Supervisor(tasks, tmp_path / "logs", backend=LocalBackend(), console=io.StringIO(), grace_period_secs=2.0,
                    faults=(parse_fault("preempt:worker:0@step=3"),)) as sup:
        result = sup.wait(60)
    assert not result.ok and result.failure.name == "worker:0"
    assert "injected preempt:worker:0@step=3" in result.failure.reason


# -- psworker scale through the run dir -----------------------------------------------------------------------

def write_run(run_dir, elastic: bool = True) -> None:
    worker = ({"addresses": [f"127.0.0.1:{2300 + i}" for i in range(4)], "min": 1, "start": 2} if elastic
              else ["127.0.0.1:2300", "127.0.0.1:2301"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "cluster.yaml").write_text(json.dumps({"cluster": {"ps": ["127.0.0.1:2299"], "worker": worker},
                                                      "train": {"mode": "async"}}))


def test_psworker_scale_reaches_the_running_supervisor(elastic_run, tmp_path):
    write_run(tmp_path)
    sup = elastic_run(E, scale_inbox=ScaleInbox(tmp_path))
    answers: list = []
    with sup:
        stepping(sup, "worker:1")
        asker = threading.Thread(target=lambda: answers.append(request_scale(tmp_path, 3, 30)))
        asker.start()
        drive_until(sup, lambda: answers, 40, "the launcher's answer")
        asker.join()
        assert answers == ["scale 2 -> 3 workers (request 1)"]
        stepping(sup, "worker:2")
        assert read_elastic_state(tmp_path)["members"]["workers"] == 3
        elastic_run.go.touch()
        assert sup.wait(60).ok
    assert read_elastic_state(tmp_path)["finished"] == "succeeded"
    with pytest.raises(UsageError, match=r"cannot scale: the run has finished \(succeeded\)"):
        request_scale(tmp_path, 2, 5)


def test_psworker_scale_refuses_bad_requests_with_exit_2(tmp_path):
    cli = [sys.executable, "-m", "psworker", "scale"]

    def scale(run_dir, workers):
        done = subprocess.run([*cli, str(run_dir), "--workers", str(workers)], capture_output=True, text=True,
                              timeout=60)
        return done.returncode, done.stderr

    code, err = scale(tmp_path / "nothing", 2)
    assert code == 2 and "not a run directory" in err
    write_run(tmp_path / "fixed", elastic=False)
    code, err = scale(tmp_path / "fixed", 2)
    assert code == 2 and "not elastic" in err
    write_run(tmp_path / "run")
    code, err = scale(tmp_path / "run", 5)
    assert code == 2 and "outside the job's elastic range 1..4" in err
    code, err = scale(tmp_path / "run", 0)
    assert code == 2 and "--workers 0 is outside the job's elastic range 1..4" in err
    code, err = scale(tmp_path / "run", 3)
    assert code == 2 and "no launcher runs this job" in err
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ScaleInbox(tmp_path / "run").publish({"workers": 2})
    state = json.loads((tmp_path / "run" / ELASTIC_FILE).read_text())
    (tmp_path / "run" / ELASTIC_FILE).write_text(json.dumps({**state, "pid": gone.pid}))
    code, err = scale(tmp_path / "run", 3)
    assert code == 2 and f"its launcher (pid {gone.pid} on" in err and "is gone" in err


def test_a_request_nobody_answers_times_out_and_is_withdrawn(tmp_path):
    write_run(tmp_path)
    ScaleInbox(tmp_path).publish({"workers": 2})       # this process plays a launcher that never reads
    with pytest.raises(PsworkerError, match=r"did not answer request 1 within 0.5 s; the request was withdrawn"):
        request_scale(tmp_path, 3, 0.5)
    assert not (tmp_path / "scale" / "1.request").exists()


# -- a late start and a leave over ssh (the real test sshd, fake workers) ----------------------------------------

@dataclasses.dataclass(frozen=True)
class RemoteTask:
    """A fake task with what the ssh backend reads: its host (`address`)."""

    job: str
    index: int
    argv: tuple[str, ...]
    address: Address
    env: tuple = ()
    is_chief: bool = False

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


def test_ssh_starts_a_worker_late_and_asks_it_to_leave(sshd, tmp_path):
    from psworker.launcher.backends.ssh.backend import SshBackend

    go = tmp_path / "go"
    chief = fake("worker", 0, "elastic_worker", "--go", go, "--hold", 3, "--to", 5)
    joiner = fake("worker", 1, "elastic_worker", "--until", go, "--to", 100000)
    tasks = [RemoteTask("worker", 0, chief.argv, Address("127.0.0.2", 1)),
             RemoteTask("worker", 1, joiner.argv, Address("127.0.0.3", 1))]
    backend = SshBackend(SshOptions(ssh_config=str(sshd.client_config)))
    sup = Supervisor(tasks, tmp_path / "logs", console=io.StringIO(), grace_period_secs=2.0, backend=backend,
                     elastic=Elastic(min=1, start=1, max=2))
    with sup:
        assert sorted(sup.pids()) == ["worker:0"]
        sup.scale(2)                                   # one more ssh connection, to 127.0.0.3
        drive_until(sup, lambda: sup.progress.snapshot()["worker:1"].step is not None, 60, "worker:1's steps")
        sup.scale(1)                                   # SIGUSR2 through `ssh 127.0.0.3 kill -USR2 PID`
        drive_until(sup, lambda: sup.members()["left"] == [1], 60, "worker:1 to leave")
        assert "leaving after step" in sup.log_path("worker:1").read_text()
        go.touch()
        result = sup.wait(60)
    assert result.ok, result.reason
    assert result.exits["worker:1"].returncode == 0 and not result.exits["worker:1"].stopped


def test_ssh_keeps_a_leave_asked_before_the_remote_pid_is_known_and_sends_it_then(sshd, tmp_path):
    """A scale-down right after a scale-up may ask a worker to leave before its connection has said the remote pid:
    the SIGUSR2 is kept and sent once the pid line is read (it used to be dropped with a warning, and the worker
    never left)."""
    from psworker.launcher.backends.ssh.backend import SshBackend

    joiner = fake("worker", 1, "elastic_worker", "--to", 100000)
    backend = SshBackend(SshOptions(ssh_config=str(sshd.client_config)))
    proc = backend.start(RemoteTask("worker", 1, joiner.argv, Address("127.0.0.3", 1)), {})
    lines: list[str] = []
    try:
        backend.signal(proc, signal.SIGUSR2)            # nothing has read its output yet: the pid is not known
        reader = threading.Thread(target=lambda: lines.extend(iter(lambda: proc.stdout.readline().decode(), "")))
        reader.start()
        reader.join(60)
        assert not reader.is_alive(), f"the worker did not leave: {lines[-5:]}"
        assert proc.wait(30) == 0 and any(line.startswith("leaving after step") for line in lines), lines[-5:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_slurm_lays_out_every_worker_up_to_max_and_keeps_the_range(tmp_path):
    """The allocation a Slurm run checks and lays out holds a slot for every worker up to max (a late worker is an
    srun step in its own slot), and the placed spec is still elastic (a listed spec as well as a count spec)."""
    from psworker.launcher.backends.slurm import allocation as sched
    from psworker.spec.plan import layout
    from psworker.spec import load_spec

    write_run(tmp_path)
    listed = load_spec(tmp_path / "cluster.yaml")
    counted = tmp_path / "counts.yaml"
    counted.write_text(json.dumps({"cluster": {"ps": 1, "worker": {"max": 4, "min": 1, "start": 2}}}))
    for spec in (listed, load_spec(counted, allow_counts=True)):
        counts = sched.count_spec(spec)
        assert counts.count("worker") == 4 and counts.elastic == E
        placed = layout(counts, ["n1", "n2"], sched.check_allocation(counts, ["n1", "n2"], [3, 2]))
        assert len(placed.worker) == 4 and placed.elastic == E


def test_preempt_faults_parse_like_the_others():
    fault = parse_fault("preempt:worker:2@step=300")
    assert (fault.action, fault.task, fault.at_step) == ("preempt", "worker:2", 300)
    assert parse_fault("preempt:worker:1@time=20").at_secs == 20
    with pytest.raises(UsageError, match="code=N applies to exit only"):
        parse_fault("preempt:worker:2@step=3,code=171")
