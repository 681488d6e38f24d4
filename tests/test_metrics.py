"""Metrics for Prometheus: the launcher's `/metrics` (`--metrics_port`) and a task's own, scraped by a real Prometheus
(tests/prometheus_fixture.py) and queried through its HTTP API; docs/operations.md's table against what is exposed; the
alert rules checked and unit-tested with promtool."""

from __future__ import annotations

import functools
import re
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Optional

import pytest
import yaml

from psworker.deadline import poll_until
from psworker.launcher import cgroups, netns, shaping
from psworker.launcher import metrics as launcher_metrics
from psworker.launcher.ports import pick_free_ports
from psworker.task import metrics as task_metrics
from psworker.testing import assert_processes_gone, write_spec
from tests import docs_pages
from tests.cluster_utils import REPO, launch_script, run_launcher
from tests.conftest import skip_or_fail
from tests.prometheus_fixture import why_no_prometheus



@functools.lru_cache(maxsize=None)
def why_no_shaping() -> Optional[str]:
    """None where `--ps_link_rate` can shape links here, else why not."""
    return shaping.missing_tool() or (None if netns.available() else "no network namespace here")
ALERTS = REPO / "docs" / "alerts.yml"
WINDOW = "[15m]"          # every query's range: longer than the test's runs
MAX_STEPS = 3000
# the one shared run: worker:1 killed (restarted once, a signal's exit class), worker:0 stopped for 8 s (stalled:
# no step for 3 s, --metrics_stall_secs)
INJECT = ("--inject", "kill:worker:1@step=300", "--inject", "stop:worker:0@step=900,for=8")


def _docs_table() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) from docs/operations.md's metric tables (section "Metrics for Prometheus")."""
    section = docs_pages.section(docs_pages.page("operations.md"), "Metrics for Prometheus")
    rows = re.findall(r"^\| `(psworker_\w+)` \| (\w+) \| ([^|]*) \|", section, re.MULTILINE)
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def _exposed(series: list[dict]) -> dict[str, set[str]]:
    """name -> label names, from Prometheus' series (its own `instance` and `job` dropped; ours, renamed
    `exported_job` by Prometheus, back to `job`)."""
    out: dict[str, set[str]] = {}
    for s in series:
        labels = {("job" if k == "exported_job" else k) for k in s if k not in ("__name__", "instance", "job")}
        out.setdefault(s["__name__"], set()).update(labels)
    return out


def _check_against_docs(series: list[dict]) -> None:
    table = _docs_table()
    exposed = _exposed(series)
    assert exposed, "no psworker_ series scraped"
    for name, labels in exposed.items():
        assert name in table, f"{name} is exposed but not in docs/operations.md's table"
        assert labels == set(table[name][1]), f"{name}: exposed labels {sorted(labels)}, docs {table[name][1]}"


def test_the_docs_table_is_the_metrics_defined():
    """Every metric the launcher and a task define is in docs/operations.md's table, with its type and labels, and no
    other (what a scrape exposes is checked against the table in the Prometheus tests below)."""
    defined = {name: (kind, labels) for table in (launcher_metrics.METRICS, task_metrics.METRICS)
               for name, (kind, labels, _) in table.items()}
    assert _docs_table() == defined


def test_exit_classes():
    c = launcher_metrics.exit_class
    assert [c(-9, None), c(137, None), c(170, None), c(171, None), c(1, None), c(3, None), c(0, None)] == \
        ["signal", "signal", "peer_gone", "preempted", "error", "error", "ok"]
    assert c(-9, "stalled: step 40 unchanged for 60 s") == "stalled"
    assert c(-9, "killed by the kernel: over its memory limit (--ps_memory_limit 1 GiB; peak 1 GiB)") == "memory_limit"
    assert set(launcher_metrics.EXIT_CLASSES) >= {c(n, None) for n in range(-64, 256)}


def test_a_public_metrics_host_or_a_taken_port_is_refused(tmp_path):
    spec = write_spec(tmp_path / "c.yaml", max_steps=10)
    done = subprocess.run([sys.executable, "-m", "psworker", "local", str(spec), "--metrics_port", "0",
                           "--set", "metrics_host=0.0.0.0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert ("refusing to serve metrics on 0.0.0.0: it names every interface of this host. The /metrics endpoint is "
            "unauthenticated; serve it on a private network only, or pass --set metrics_allow_public_bind=true") in done.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.log"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "psworker", "worker", "--spec", str(spec), "--task_index", "1",
                               "--metrics_port", str(port)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"psworker: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use" in done.stderr


def test_alert_rules_check_and_fire(tmp_path):
    """docs/alerts.yml passes `promtool check rules`, and each rule fires on the series it is written for
    (`promtool test rules`)."""
    reason = why_no_prometheus()
    if reason:
        skip_or_fail("prometheus", reason)
    checked = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS: 3 rules found" in checked.stdout, checked.stdout + checked.stderr
    worker = {"instance": "a:1", "exported_job": "worker", "task": "1"}
    sel = ",".join(f'{k}="{v}"' for k, v in worker.items())

    def alert(name: str, at: str, labels: dict, summary: str, description: str) -> dict:
        return {"eval_time": at, "alertname": name, "exp_alerts": [
            {"exp_labels": labels, "exp_annotations": {"summary": summary, "description": description}}]}

    cases = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f"psworker_task_stalled{{{sel}}}", "values": "0 0 1 1 1 1 1"},
            {"series": 'psworker_checkpoint_age_seconds{instance="a:1"}', "values": "0+60x45"},
            {"series": 'psworker_run_state{instance="a:1",state="running"}', "values": "1x45"},
            {"series": f'psworker_task_restarts_total{{{sel},exit_class="signal"}}', "values": "0 1 2 3 4 5 6"}],
        "alert_rule_test": [
            alert("PsworkerWorkerStalled", "6m", {**worker, "severity": "warning"},
                  "psworker worker 1 of a:1 is stalled",
                  "Its step has not moved for the stall threshold; psworker status RUN_DIR shows its last lines."),
            {"eval_time": "3m", "alertname": "PsworkerWorkerStalled", "exp_alerts": []},
            alert("PsworkerNoCheckpoint", "40m", {"instance": "a:1", "severity": "warning"},
                  "psworker run at a:1: no checkpoint for 40m 0s",
                  "The chief writes none (save_checkpoint_steps/secs), or it cannot (disk, chief stuck)."),
            {"eval_time": "33m", "alertname": "PsworkerNoCheckpoint", "exp_alerts": []},
            alert("PsworkerTaskRestartLoop", "6m", {**worker, "severity": "critical"},
                  "psworker task 1 of a:1 restarts in a loop",
                  "6 restarts in 15 minutes; psworker_task_last_exit_code says how it last ended."),
            {"eval_time": "2m", "alertname": "PsworkerTaskRestartLoop", "exp_alerts": []}]}]}
    (tmp_path / "cases.yml").write_text(yaml.safe_dump(cases))
    tested = subprocess.run(["promtool", "test", "rules", str(tmp_path / "cases.yml")], capture_output=True,
                            text=True, timeout=60)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def launcher_run(prometheus, tmp_path_factory):
    """One `psworker local --metrics_port 0` run (1 ps, 2 async workers), scraped by Prometheus from the banner's
    port on; what it printed, its port, a raw scrape taken mid-run, its train dir and the time window."""
    work = tmp_path_factory.mktemp("launcher_metrics")
    spec = write_spec(work / "c.yaml", max_steps=MAX_STEPS, batch_size=32, log_every_steps=20,
                      save_checkpoint_steps=1000, train_dir=str(work / "train"))
    seen: dict = {"started": time.time()}

    def on_line(lines: list[str], proc) -> bool:
        text = "\n".join(lines)
        if "port" not in seen:
            m = re.search(r"metrics for Prometheus at http://127\.0\.0\.1:(\d+)/metrics", text)
            if m:
                seen["port"] = int(m.group(1))
                prometheus.add_targets("launcher", [f"127.0.0.1:{seen['port']}"])
        if "port" in seen and re.search(r"\] step \d+", text):
            with urllib.request.urlopen(f"http://127.0.0.1:{seen['port']}/metrics", timeout=10) as r:
                seen["raw"] = r.read().decode()
            return True
        return False

    shaped = ["--ps_link_rate", "10gbit"] if why_no_shaping() is None else []     # psworker_ps_link_bytes_total
    run = run_launcher([str(spec), "--metrics_port", "0", "--metrics_stall_secs", "3", "--max_restarts", "1",
                        "--console", "plain", *INJECT, *shaped], work, timeout=400, on_line=on_line)
    assert run.returncode == 0, run.output[-3000:]
    assert "raw" in seen, run.output[-3000:]
    return {**seen, "run": run, "train_dir": work / "train", "ended": time.time()}


@pytest.mark.slow
def test_prometheus_scrapes_a_local_run(prometheus, launcher_run):
    """The step rising; the injected kill's restart counted as a signal's (137); the injected stop seen as stalled;
    the final checkpoint's step and the run's success, from the last scrape (the launcher serves until it)."""
    p, r = prometheus, launcher_run
    steps = p.query_range("psworker_global_step", r["started"], r["ended"])
    values = [float(v) for _, v in steps[0]["values"]]
    assert values == sorted(values) and len(set(values)) >= 3, values
    # the last scrape may fall between the range's last 1 s point and its end, and be appended after the run ends
    last = poll_until(lambda: (p.value(f"last_over_time(psworker_global_step{WINDOW})") or 0) >= MAX_STEPS, 30)
    assert last, (values, p.value(f"last_over_time(psworker_global_step{WINDOW})"))
    worker1 = 'exported_job="worker",task="1"'
    assert p.value(f'max_over_time(psworker_task_restarts_total{{{worker1},exit_class="signal"}}{WINDOW})') == 1
    assert p.value(f"sum(max_over_time(psworker_task_restarts_total{WINDOW}))") == 1     # no other restart
    assert p.value(f"max_over_time(psworker_task_last_exit_code{{{worker1}}}{WINDOW})") == 137
    stalled = ('psworker_task_stalled{exported_job="worker",task="0"} == 1 and on(exported_job, task) '
               'psworker_task_state{exported_job="worker",task="0",state="paused"} == 1')
    assert p.value(f"count_over_time(({stalled}){WINDOW[:-1]}:1s])") >= 1
    saved = re.findall(r"worker:0: checkpoint of global step (\d+) saved",
                       (r["train_dir"] / "logs" / "worker-0.log").read_text())     # the chief's own word
    assert p.value(f"last_over_time(psworker_checkpoint_step{WINDOW})") == int(saved[-1]) >= MAX_STEPS
    assert p.value(f'last_over_time(psworker_run_state{{state="succeeded"}}{WINDOW})') == 1
    assert _closed(r["port"]), "the launcher's metrics port is still open"
    assert_processes_gone(r["run"].pids)


@pytest.mark.slow
def test_the_ps_link_bytes_under_ps_link_rate(prometheus, launcher_run):
    """With --ps_link_rate, each ps link's bytes (tc's counters) rise, up to what the run's last lines report."""
    if why_no_shaping() is not None:
        skip_or_fail("netns", f"--ps_link_rate needs a network namespace and tc: {why_no_shaping()}")
    p, r = prometheus, launcher_run
    report = re.search(r"ps:0 link \(10gbit each way\): ([0-9.]+) MB to it, ([0-9.]+) MB from it", r["run"].output)
    assert report, r["run"].output[-2000:]
    for direction, reported_mb in zip(("to_ps", "from_ps"), map(float, report.groups())):
        series = p.query_range(f'psworker_ps_link_bytes_total{{task="0",direction="{direction}"}}', r["started"],
                               r["ended"])
        values = [float(v) for _, v in series[0]["values"]]
        assert values == sorted(values) and 0 < values[-1] <= reported_mb * 1e6 + 0.05e6, (direction, values)


@pytest.mark.slow
def test_the_launcher_exposes_what_the_readme_says(prometheus, launcher_run):
    """Names and labels as the docs' table has them; `promtool check metrics` finds nothing in a raw scrape."""
    _check_against_docs(prometheus.series('{__name__=~"psworker_.*"}', launcher_run["started"]))
    linted = subprocess.run(["promtool", "check", "metrics"], input=launcher_run["raw"], capture_output=True,
                            text=True, timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.slow
def test_prometheus_scrapes_the_tasks_of_a_cluster_started_by_hand(prometheus, make_cluster):
    """ps and workers started with launch/start_*.sh --metrics_port: each task's own endpoint, scraped."""
    started = time.time()
    ports = dict(zip(("ps:0", "worker:0", "worker:1"), pick_free_ports(3)))
    prometheus.add_targets("tasks", [f"127.0.0.1:{port}" for port in ports.values()])
    args = {name: ["--metrics_port", str(port)] for name, port in ports.items()}
    args["ps:0"].append("--keep_ps_running")     # its last tokens stay there to be scraped
    cluster = make_cluster(train=dict(max_steps=MAX_STEPS, batch_size=32, log_every_steps=20), argv=launch_script,
                           args=args)
    assert cluster.wait_exits(240, ["worker:0", "worker:1"]) == {"worker:0": 0, "worker:1": 0}, cluster.tails()
    p, ps = prometheus, 'exported_job="ps",task="0"'
    p.wait_value(f"psworker_ps_done_tokens_total{{{ps}}}", lambda v: v == 2, "both done tokens", 30)
    assert p.value(f"psworker_ps_members{{{ps}}}") == 2
    assert p.value(f"max_over_time(psworker_task_resident_memory_bytes{{{ps}}}{WINDOW})") > 50e6
    steps = p.query_range('psworker_worker_step{exported_job="worker",task="0"}', started, time.time())
    values = [float(v) for _, v in steps[0]["values"]]
    assert values == sorted(values) and len(set(values)) >= 2, values
    _check_against_docs(p.series('{__name__=~"psworker_(worker|ps|task)_.*",exported_job=~"ps|worker",'
                                   'instance=~"127.0.0.1:(%s)"}' % "|".join(map(str, ports.values())), started))
    cluster.close()
    assert all(_closed(port) for port in ports.values()), "a task's metrics port is still open"
    assert_processes_gone(cluster.pids)


NO_MEMCG = cgroups.unavailable()


@pytest.mark.skipif(NO_MEMCG is not None, reason=f"no memory cgroup here: {NO_MEMCG}")
def test_a_task_reads_its_cgroup_memory_limit(tmp_path):
    """`psworker_task_memory_limit_bytes`: a process in a capped v1 memory cgroup (as `--ps_memory_limit` makes
    one) reads that cap; its RSS is read too."""
    import secrets

    limit = 700 * 2 ** 20
    group = cgroups.create(cgroups.own_memory_cgroup(), cgroups.new_name(0, secrets.token_hex(4)), limit)
    try:
        done = subprocess.run([sys.executable, "-c", "from psworker.task.metrics import memory_limit, _resident_bytes; "
                               "print(memory_limit(), _resident_bytes())"], preexec_fn=group.joiner(),
                              capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        group.remove()
    assert done.returncode == 0, done.stderr
    cap, rss = map(int, done.stdout.split())
    assert cap == limit and 1e6 < rss < limit


def test_slurm_submit_passes_the_metrics_flags_to_the_jobs_launcher(tmp_path):
    """`slurm submit --metrics_port ...`: the batch script's `psworker slurm launch` gets them (and nothing when not
    given)."""
    import shlex

    from psworker.cli import main

    spec = REPO / "cluster_specs" / "local.yaml"
    for name, flags in (("on", ["--metrics_port", "9400", "--set", "metrics_host=10.1.2.3", "--set",
                                "metrics_stall_secs=60", "--set", "metrics_allow_public_bind=true"]), ("off", [])):
        assert main(["slurm", "submit", str(spec), "--run_dir", str(tmp_path / name), *flags, "--dry_run"]) == 0
        exec_line = [ln for ln in (tmp_path / name / "psworker.sbatch").read_text().splitlines()
                     if ln.startswith("exec ")]
        argv = shlex.split(exec_line[0])
        passed = [a for a in argv if a.startswith("--metrics") or a.startswith("metrics")]
        assert passed == ([] if name == "off" else ["--metrics_port", "metrics_host=10.1.2.3",
                                                     "metrics_stall_secs=60.0", "metrics_allow_public_bind=true"])


def _scraped(registry) -> dict[str, set[str]]:
    """name -> label names of a registry's exposition, parsed back as Prometheus reads it."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_every_metric_renders_with_the_readme_labels(tmp_path):
    """Each metric the live runs above do not show (an elastic job's counts, the epochs to train, a ps's members
    and done tokens, a leaving worker): the launcher's collector over a real `Progress` fed as the launcher feeds it,
    and a task's `Watcher` fed its own lines, expose every metric of docs/operations.md's table with its labels."""
    from prometheus_client import CollectorRegistry

    from psworker import events
    from psworker.launcher.console.progress import Progress
    from psworker.launcher.shaping import PortBytes

    class Run:        # what the collector reads of a `Supervisor`
        progress = Progress(["ps:0", "worker:0", "worker:1"])

        def ended_attempts(self):
            return {"worker:1": (((-9, None),), None), "ps:0": ((), (0, None))}

    run = Run()
    run.progress.set_workers(2, 3)
    run.progress.feed("worker:0", events.Step(40, 0.5, 800.0, 0.04, 1.25, 3).render())
    (tmp_path / "model.ckpt-40.index").write_bytes(b"")
    collector = launcher_metrics.RunCollector(launcher_metrics.RunFacts(
        300.0, tmp_path, 100, lambda: [PortBytes(10, 20)]))
    collector.attach(run)
    table = _docs_table()
    registries = [CollectorRegistry(auto_describe=False) for _ in range(3)]
    registries[0].register(collector)
    for registry, (job, lines) in zip(registries[1:], (
            ("worker", [events.Step(40, 0.5, 800.0, 0.04).render(), "worker:1: got SIGUSR2: scaled away; leaving "
                        "the job (told every ps)", events.WorkerDone("worker:1", 50, 20, 3.0).render()]),
            ("ps", ["ps:0: worker:1 joined the job (members now: worker:0, worker:1)",
                    "ps:0: worker:1 is done (1 of 2)"]))):
        watcher = task_metrics.Watcher(job, 1 if job == "worker" else 0, 1)
        for line in lines:
            watcher.line(line)
        registry.register(watcher)
    exposed = {name: labels for registry in registries for name, labels in _scraped(registry).items()}
    capped = {"psworker_task_memory_limit_bytes"}      # only in a capped cgroup (its own test above)
    assert set(table) - capped <= set(exposed) <= set(table), set(table) ^ set(exposed)
    for name, labels in exposed.items():
        assert labels == set(table[name][1]), (name, labels)
    watcher_values = {s.name: s.value for s in registries[1].collect() for s in s.samples}
    assert watcher_values["psworker_worker_leaving"] == 1 and watcher_values["psworker_worker_done"] == 1
    ps_values = {s.name: s.value for s in registries[2].collect() for s in s.samples}
    assert ps_values["psworker_ps_members"] == 2 and ps_values["psworker_ps_done_tokens_total"] == 1
