"""`--ps_link_rate`: a link per ps port on `lo` (psworker.launcher.shaping). Pure tests of the rate parser, the tc
argv lists and the counter parser; the tc commands themselves, run in a real private namespace with real traffic;
and `psworker local --ps_link_rate` end to end (banner, the bytes each ps moved, refusals)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from psworker.launcher import netns, shaping
from psworker.launcher.shaping import LinkShaping, PortBytes, parse_rate
from tests.cluster_utils import REPO, task_env


@pytest.mark.parametrize("text,bps", [
    ("100mbit", 100_000_000), ("1gbit", 10 ** 9), ("10gbit", 10 ** 10), ("200mbit", 200_000_000),
    ("1.5Gbit", 1_500_000_000), ("64kbit", 64_000), ("1mibit", 1024 ** 2), ("12MBps", 96_000_000),
    ("1000000", 1_000_000), (" 20mbit ", 20_000_000), ("1tbit", 10 ** 12), (".5gbit", 500_000_000),
])
def test_parse_rate_reads_tc_units(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text,says", [
    ("", "is not a rate"), ("fast", "is not a rate"), ("100mb", "is not a rate"), ("-1gbit", "is not a rate"),
    ("10 mbit/s", "is not a rate"), ("1kbit", "at least 8kbit"), ("0gbit", "at least 8kbit"),
])
def test_parse_rate_refuses_what_tc_would_not_take(text, says):
    with pytest.raises(ValueError, match=says):
        parse_rate(text)


def test_format_rate_round_trips():
    for text in ("100mbit", "1gbit", "10gbit", "1.5gbit", "64kbit", "8kbit"):
        assert shaping.format_rate(parse_rate(text)) == text


def test_setup_argvs_give_each_ps_port_a_class_per_direction():
    """Plus one pooled class for what leaves the workers' ports: the gradients the ps pull (TF's receiver pulls)."""
    argvs = shaping.setup_argvs(LinkShaping(parse_rate("100mbit"), (5001, 5002), (6001, 6002)))
    assert argvs[0] == ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"]
    assert argvs[1][:9] == ["tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1"]
    assert argvs[1][argvs[1].index("rate") + 1] == f"{shaping.FAST_RATE_BPS}bit"
    classes = {a[a.index("classid") + 1]: a[a.index("rate") + 1] for a in argvs if a[1] == "class"}
    assert classes == {"1:1": f"{shaping.FAST_RATE_BPS}bit", "1:10": "100000000bit", "1:11": "100000000bit",
                       "1:12": "100000000bit", "1:13": "100000000bit", "1:2": "200000000bit"}
    filters = [(a[a.index("match") + 2:a.index("match") + 4], a[-1]) for a in argvs if a[1] == "filter"]
    assert filters == [(["dport", "5001"], "1:10"), (["sport", "5001"], "1:11"),
                       (["dport", "5002"], "1:12"), (["sport", "5002"], "1:13"),
                       (["sport", "6001"], "1:2"), (["sport", "6002"], "1:2")]
    for a in argvs:
        if a[1] == "class":   # burst above loopback's 64 KiB packets, else HTB stalls on them
            assert int(a[a.index("burst") + 1].rstrip("b")) >= 65536
            assert a[a.index("ceil") + 1] == a[a.index("rate") + 1]


def test_linkshaping_refuses_shared_or_bad_ports():
    with pytest.raises(ValueError, match="distinct"):
        LinkShaping(10 ** 8, (5001, 5001))
    with pytest.raises(ValueError, match="distinct"):
        LinkShaping(10 ** 8, (5001,), (5001,))
    with pytest.raises(ValueError, match="at least one ps"):
        LinkShaping(10 ** 8, ())
    with pytest.raises(ValueError, match="distinct"):
        LinkShaping(10 ** 8, (0,))


_TC_SHOW = """class htb 1:11 root leaf 8011: prio 0 rate 100Mbit ceil 100Mbit burst 128Kb cburst 128Kb
 Sent 5300 bytes 20 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
 lended: 20 borrowed: 0 giants: 0

class htb 1:1 root prio 0 rate 100Gbit ceil 100Gbit burst 128Kb cburst 128Kb
 Sent 123 bytes 2 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0

class htb 1:10 root leaf 8010: prio 0 rate 100Mbit ceil 100Mbit burst 128Kb cburst 128Kb
 Sent 4212345 bytes 301 pkt (dropped 0, overlimits 12 requeues 0)
 backlog 0b 0p requeues 0

class htb 1:2 root leaf 8002: prio 0 rate 200Mbit ceil 200Mbit burst 250Kb cburst 250Kb
 Sent 4000000 bytes 100 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_counters_are_read_per_class_and_per_ps():
    counters = shaping.parse_class_bytes(_TC_SHOW)
    assert counters == {"1:11": 5300, "1:1": 123, "1:10": 4212345, "1:2": 4000000}
    two = LinkShaping(10 ** 8, (5001, 5002), (6001,))
    assert shaping.port_bytes(two, counters) == [PortBytes(4212345, 5300), PortBytes(0, 0)]
    assert shaping.report_lines(two, counters) == [
        "ps:0 link (100mbit each way): 4.2 MB to it, 5.3 kB from it",
        "ps:1 link (100mbit each way): 0.0 kB to it, 0.0 kB from it",
        "ps links (2 x 100mbit pooled): 4.0 MB of gradients pulled from the workers, in addition to the 'to it' above"]
    one = LinkShaping(10 ** 8, (5001,), (6001,))   # one ps: what the workers' ports sent is all its own
    assert shaping.port_bytes(one, counters) == [PortBytes(8212345, 5300)]
    assert shaping.report_lines(one, counters) == ["ps:0 link (100mbit each way): 8.2 MB to it, 5.3 kB from it"]


_needs_namespace = pytest.mark.skipif(not (netns.available() and shutil.which("tc")),
                                      reason="needs a network namespace (unshare) and tc")

_FLOW = r"""
import socket, sys, threading, time
from psworker.launcher import netns, shaping
netns.bring_up_loopback()
shaped, free = socket.socket(), socket.socket()
for s in (shaped, free):
    s.bind(("127.0.0.1", 0)); s.listen(1)
link = shaping.LinkShaping(shaping.parse_rate(sys.argv[1]), (shaped.getsockname()[1],))
shaping.install(link)
def flow(srv, n_in, n_out):
    def serve():
        c, _ = srv.accept(); got = 0
        while got < n_in:
            got += len(c.recv(1 << 20))
        c.sendall(b"o" * n_out); c.close()
    t = threading.Thread(target=serve); t.start()
    cl = socket.create_connection(srv.getsockname()); start = time.monotonic()
    cl.sendall(b"i" * n_in); got = 0
    while got < n_out:
        got += len(cl.recv(1 << 20))
    t.join(); return time.monotonic() - start
secs = flow(shaped, 2_000_000, 500_000)
free_secs = flow(free, 2_000_000, 500_000)
b = shaping.class_bytes(link)[0]
print(f"shaped {secs:.3f} free {free_secs:.3f} to {b.to_ps} from {b.from_ps}")
"""


@_needs_namespace
def test_installed_shaping_limits_one_port_and_counts_its_bytes():
    """Real tc in a real namespace: 2.5 MB through a 20mbit port takes >= 0.8 s (1 s at full rate), the same
    through an unshaped port far less; the port's classes count the bytes each way."""
    done = subprocess.run([*netns.UNSHARE, sys.executable, "-c", _FLOW, "20mbit"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, cwd=REPO, env=task_env())
    assert done.returncode == 0, done.stderr[-3000:]
    m = re.search(r"shaped (\S+) free (\S+) to (\d+) from (\d+)", done.stdout)
    assert m, done.stdout
    secs, free_secs, to_ps, from_ps = float(m[1]), float(m[2]), int(m[3]), int(m[4])
    assert secs >= 0.8, done.stdout
    assert free_secs < secs / 2, done.stdout
    assert 2_000_000 <= to_ps < 2_300_000 and 500_000 <= from_ps < 700_000, done.stdout


_SPEC = """cluster:
  ps: ["localhost:auto"]
  worker: ["localhost:auto"]
train:
  model: mlp
  batch_size: 32
"""
_LINK_LINE = re.compile(r"^psworker: ps:0 link \(20mbit each way\): ([0-9.]+) (MB|kB) to it, ([0-9.]+) (MB|kB) "
                        r"from it$", re.MULTILINE)


def _psworker(*args: str, cwd, env=None, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """`python -m psworker ARGS`, its whole session ended if it outlives `timeout` (nothing left behind)."""
    proc = subprocess.Popen([sys.executable, "-m", "psworker", *args], cwd=cwd, env=env or task_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"psworker {' '.join(args)} still ran after {timeout:g} s:\n{(out + err)[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _step_bytes(spec, cwd) -> tuple[int, int]:
    """What `psworker plan --model` says one worker step pulls from the ps and pushes to it."""
    done = _psworker("plan", str(spec), "--model", "mlp", cwd=cwd, timeout=180)
    m = re.search(r"pulls ([0-9,]+) bytes from the ps tasks, pushes ([0-9,]+) bytes", done.stdout)
    assert done.returncode == 0 and m, done.stdout + done.stderr[-3000:]
    return int(m[1].replace(",", "")), int(m[2].replace(",", ""))


@pytest.mark.slow
@_needs_namespace
def test_local_run_shaped_reports_the_bytes_each_ps_link_moved(tmp_path):
    """The digits MLP, 1 ps + 1 worker, the ps link at 20mbit: the banner says so, the run succeeds, and the report's
    tc counters hold at least a step's variables each way per step (pull) and per step (gradients), and not far
    more (checkpoint, export and evaluation reads add a few steps' worth)."""
    spec = tmp_path / "mlp.yaml"
    spec.write_text(_SPEC)
    steps = 40
    done = _psworker("local", str(spec), "--ps_link_rate", "20mbit", "--max_steps", str(steps), "--train_dir",
                     str(tmp_path / "run"), cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    banner = next((line for line in out.splitlines() if line.startswith("psworker: starting 2 tasks")), "")
    assert "each ps link shaped to 20mbit per direction on lo (tc htb: ps:0 port " in banner, out[-4000:]
    m = _LINK_LINE.search(done.stdout)
    assert m, out[-4000:]
    scale = {"MB": 1e6, "kB": 1e3}
    to_ps, from_ps = float(m[1]) * scale[m[2]], float(m[3]) * scale[m[4]]
    pull, push = _step_bytes(spec, tmp_path)
    for moved, per_step in ((to_ps, push), (from_ps, pull)):
        assert steps * per_step <= moved <= (1.5 * steps + 10) * per_step, (moved, per_step, out[-3000:])
    assert not [p for p in _run_processes(tmp_path / "run")]


def _run_processes(run_dir):
    from psworker.testing import processes_naming
    return processes_naming(run_dir)


def test_local_refuses_to_shape_without_tc_with_network_host_or_a_bad_rate(tmp_path):
    """Exit 2 before anything starts, naming the flag and what is missing; no traceback."""
    spec = tmp_path / "mlp.yaml"
    spec.write_text(_SPEC)
    bad = _psworker("local", str(spec), "--ps_link_rate", "fast", cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "argument --ps_link_rate: 'fast' is not a rate" in bad.stderr, bad.stderr
    host = _psworker("local", str(spec), "--ps_link_rate", "1gbit", "--network", "host", cwd=tmp_path, timeout=120)
    assert host.returncode == 2, host.stderr
    assert "--ps_link_rate shapes the links inside the run's private network namespace; it cannot be used with " \
           "--network host" in host.stderr
    bin_dir = tmp_path / "bin"   # a PATH with everything but tc
    bin_dir.mkdir()
    for tool in ("unshare",):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bin_dir / tool)
    no_tc = _psworker("local", str(spec), "--ps_link_rate", "1gbit", cwd=tmp_path, timeout=120,
                      env=task_env(PATH=str(bin_dir)))
    assert no_tc.returncode == 2, no_tc.stderr
    assert "--ps_link_rate: cannot shape the ps links here: missing the 'tc' command (iproute2) on PATH" \
        in no_tc.stderr
    for done in (bad, host, no_tc):
        assert "Traceback" not in done.stderr and "starting" not in done.stdout
