"""TensorBoard served from a run dir: answers on 127.0.0.1, lists the runs to a real headless Chromium, and is
gone (with its port) after the `with` block."""

from __future__ import annotations

import contextlib
import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("tensorboard")

from psworker.launcher import tensorboard
from psworker.train import summaries  # noqa: E402
from psworker.testing import assert_processes_gone as assert_no_processes  # noqa: E402
from tests.cluster_utils import descendants  # noqa: E402

START_TIMEOUT = 180.0   # TensorBoard imports TensorFlow: 5-20 s on 2 busy cores
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def write_runs(logdir) -> None:
    for index in (0, 1):
        writer = summaries.make_writer(summaries.worker_dir(str(logdir), index))
        for step in (10, 20):
            writer.add_summary(summaries.scalar_summary({f"worker_{index}/loss": 1.0 / step}), step)
        writer.close()
    summaries.write_eval_summary(str(logdir), 0.9, 20)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def wait_for_runs(url: str, expected: set, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        runs = get_json(url + "data/runs")
        if set(runs) >= expected:
            return runs
        if time.monotonic() > deadline:
            raise AssertionError(f"TensorBoard listed {runs} after {timeout:g} s, expected {sorted(expected)}")
        time.sleep(0.5)


def children_of_this_process() -> set[int]:
    return set(descendants(os.getpid()))


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # closed connections may linger in TIME_WAIT
        try:
            s.bind((tensorboard.HOST, port))
            return True
        except OSError:
            return False


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (CI installs Debian's chromium: .ci/run)")
def test_headless_chromium_sees_the_runs(tmp_path):
    write_runs(tmp_path / "run")
    before = children_of_this_process()
    with tensorboard.serve(str(tmp_path / "run"), timeout_secs=START_TIMEOUT, reload_interval_secs=1) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        assert url == f"http://127.0.0.1:{port}/"
        pids = children_of_this_process() - before
        assert pids
        assert set(wait_for_runs(url, {"worker_0", "worker_1", "eval"})) == {"worker_0", "worker_1", "eval"}
        dom = chromium_dom(url + "#timeseries", tmp_path / "profile")
    # The time-series dashboard's run table has one row per run; its chart groups are the tag prefixes.
    for run in ("worker_0", "worker_1", "eval"):
        assert f'data-id="defaultExperimentId/{run}"' in dom, run
    assert 'title="worker_1"' in dom
    assert_no_processes(pids)
    assert port_is_free(port)


def chromium_dom(url: str, profile, budget_ms: int = 15000, timeout: float = 120.0) -> str:
    """The page's DOM after `budget_ms` of virtual time in headless Chromium (its own process group, killed on
    timeout)."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"chromium did not finish loading {url} within {timeout:g} s") from None
    finally:
        try:   # renderer or GPU helpers left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-2000:]
    assert "<tb-webapp" in out, out[:2000]
    return out


@pytest.mark.slow
def test_serve_stops_tensorboard_when_the_block_raises(tmp_path):
    write_runs(tmp_path)
    before = children_of_this_process()
    with pytest.raises(RuntimeError, match="inside"):
        with tensorboard.serve(str(tmp_path), timeout_secs=START_TIMEOUT) as url:
            pids = children_of_this_process() - before
            assert get_json(url + "data/runs") is not None
            raise RuntimeError("inside")
    assert_no_processes(pids)


def test_serve_gives_up_with_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A server that never answers (a stand-in: the real TensorBoard may well answer within any timeout short enough
    for a test): `serve` gives up after its timeout, says so, and leaves no process."""
    from tests.fake_tasks.fakes import HERE

    never = [sys.executable, str(HERE / "sleep_forever.py")]
    monkeypatch.setattr(tensorboard, "command", lambda logdir, port, **kwargs: never)
    before = children_of_this_process()
    with pytest.raises(tensorboard.TensorBoardError, match=r"did not answer at http://127\.0\.0\.1:\d+/ within"):
        with tensorboard.serve(str(tmp_path), timeout_secs=0.5):
            pass
    assert children_of_this_process() - before == set()


def start_cli(logdir) -> tuple[subprocess.Popen, str, set[int]]:
    """`psworker tensorboard --logdir D --port 0` in its own group; returns it, its URL and its descendants."""
    import threading

    from tests.cluster_utils import task_env

    proc = subprocess.Popen([sys.executable, "-m", "psworker", "tensorboard", "--logdir", str(logdir), "--port", "0"],
                            env=task_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not any("TensorBoard at" in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"psworker tensorboard printed no URL within {START_TIMEOUT:g} s: {lines}")
        time.sleep(0.2)
    url = next(line for line in lines if "TensorBoard at" in line).split()[-1]
    return proc, url, set(descendants(proc.pid))


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)],
                         ids=["SIGTERM", "SIGKILL"])
def test_cli_stops_tensorboard_when_it_is_stopped_or_killed(tmp_path, sig, code):
    write_runs(tmp_path)
    proc, url, pids = start_cli(tmp_path)
    try:
        assert url.startswith("http://127.0.0.1:") and pids
        assert "eval" in get_json(url + "data/runs")
        proc.send_signal(sig)   # SIGKILL: TensorBoard goes by PR_SET_PDEATHSIG
        assert proc.wait(timeout=30) == code
        assert_no_processes(pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_tensorboard_serves_the_run_while_it_lasts_and_stops_with_it(tmp_path):
    """`psworker local --tensorboard`: the URL answers during the run, from this host's network (the launcher itself
    moves into a private namespace), lists the workers' runs once they write summaries, and TensorBoard is gone
    when the launcher exits. The launcher's own fault injection holds both workers (SIGSTOP) from global step 200
    on, so the run cannot end before TensorBoard lists the runs, however long that takes; then the test resumes
    them (SIGCONT) and the run ends by itself."""
    import json
    import urllib.request

    from psworker.testing import assert_processes_gone
    from tests.cluster_utils import REPO, run_launcher

    seen: dict[str, object] = {}
    held = [re.compile(rf"injecting stop:worker:{i}@step=200,for=600 at global step") for i in (0, 1)]

    def probe(lines, proc) -> bool:
        text = "\n".join(lines)
        found = re.search(r"TensorBoard at (http://127\.0\.0\.1:\d+/)", text)
        if found is None or not all(h.search(text) for h in held):
            return False
        seen["url"] = found.group(1)
        seen.setdefault("held_at", time.monotonic())
        try:
            with urllib.request.urlopen(seen["url"] + "data/runs", timeout=10.0) as response:
                seen["runs"] = json.loads(response.read())
        except OSError:
            seen["runs"] = None
        if not any(r.startswith("worker_") for r in seen["runs"] or ()):
            if time.monotonic() - seen["held_at"] > START_TIMEOUT:
                raise AssertionError(f"TensorBoard listed {seen['runs']} {START_TIMEOUT:g} s after both workers "
                                     f"were held:\n{text[-3000:]}")
            return False
        for pid in descendants(proc.pid):     # resume the held workers (harmless to the other processes)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return True

    run = run_launcher([str(REPO / "cluster_specs/local.yaml"), "--tensorboard", "--max_steps", "1000",
                        "--log_every_steps", "100", "--inject", "stop:worker:0@step=200,for=600",
                        "--inject", "stop:worker:1@step=200,for=600"], tmp_path, 420, on_line=probe)
    assert any(r.startswith("worker_") for r in seen.get("runs") or ()), (seen, run.output[-3000:])
    assert run.returncode == 0, run.output[-3000:]
    assert run.output.splitlines()[-1] == (f"psworker: TensorBoard stopped with the run; psworker tensorboard "
                                           f"--logdir {run.output.split('train_dir is ')[1].split()[0]} serves it "
                                           "again"), run.output[-3000:]
    assert_processes_gone(run.pids)
    with pytest.raises(OSError):
        urllib.request.urlopen(str(seen["url"]) + "data/runs", timeout=2.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_a_terminal_tensorboard_serves_the_run_after_it_until_ctrl_c(tmp_path):
    """On a terminal (the console a pty, as a person runs it), `psworker local --tensorboard` serves on once the run
    is over, every worker's run and the eval listed, until Ctrl-C (SIGINT); the launcher then exits with the run's
    status, 0, and TensorBoard is gone with its port. Off a terminal it stops with the run (the test above)."""
    from psworker.testing import assert_processes_gone
    from tests.cluster_utils import REPO, Launcher

    run = Launcher([str(REPO / "cluster_specs/local.yaml"), "--tensorboard", "--max_steps", "300",
                    "--train_dir", str(tmp_path / "t")], tmp_path, tty=True)
    try:
        _, started = run.wait_for(r"TensorBoard at (http://127\.0\.0\.1:\d+/) \(127\.0\.0\.1 only\) shows the run "
                                  r"from its first step, and after it until Ctrl-C", "the TensorBoard line")
        url = started.group(1)
        run.wait_for(rf"psworker: TensorBoard at {re.escape(url)} serves the run until Ctrl-C", "the run's end")
        assert run.find(r"psworker: precision @ 1 = ") is not None, run.tail()
        assert set(wait_for_runs(url, {"worker_0", "worker_1", "eval"}, timeout=60)) >= {"worker_0", "eval"}
        assert run.proc.poll() is None, run.tail()          # the run is over; TensorBoard serves on
        assert run.end(signal.SIGINT) == 0, run.tail()     # the run's status, not Ctrl-C's
    finally:
        run.close()
    assert [line for line in run.snapshot() if line.strip()][-1] == (f"psworker: TensorBoard stopped with the run; psworker tensorboard --logdir "
                                  f"{tmp_path / 't'} serves it again"), run.tail()
    assert_processes_gone(run.pids)
    assert port_is_free(int(url.rstrip("/").rsplit(":", 1)[1]))
