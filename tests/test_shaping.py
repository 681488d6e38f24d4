"""`--ps_link_rate`: a link per ps port on `lo` (psworker.launcher.shaping). Pure tests of the rate parser, the tc
argv lists and the counter parser; the tc commands themselves, run in a real private namespace with real traffic;
and `psworker local --ps_link_rate` end to end (banner, the bytes each ps moved, refusals)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading

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
    argvs = shaping.setup_argvs(LinkShaping(parse_rate("100mbit"), (5001, 5002)))
    assert argvs[0] == ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"]
    assert argvs[1][:9] == ["tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1"]
    assert argvs[1][argvs[1].index("rate") + 1] == f"{shaping.FAST_RATE_BPS}bit"
    classes = {a[a.index("classid") + 1]: a[a.index("rate") + 1] for a in argvs if a[1] == "class"}
    assert classes == {"1:1": f"{shaping.FAST_RATE_BPS}bit", "1:10": "100000000bit", "1:11": "100000000bit",
                       "1:12": "100000000bit", "1:13": "100000000bit"}
    filters = [(a[a.index("match") + 2:a.index("match") + 4], a[-1]) for a in argvs if a[1] == "filter"]
    assert filters == [(["dport", "5001"], "1:10"), (["sport", "5001"], "1:11"),
                       (["dport", "5002"], "1:12"), (["sport", "5002"], "1:13")]
    for a in argvs:
        if a[1] == "class":   # burst above loopback's 64 KiB packets, else HTB stalls on them
            assert int(a[a.index("burst") + 1].rstrip("b")) >= 65536
            assert a[a.index("ceil") + 1] == a[a.index("rate") + 1]


def test_linkshaping_refuses_shared_or_bad_ports():
    with pytest.raises(ValueError, match="distinct"):
        LinkShaping(10 ** 8, (5001, 5001))
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
"""


def test_counters_are_read_per_class_and_per_ps():
    counters = shaping.parse_class_bytes(_TC_SHOW)
    assert counters == {"1:11": 5300, "1:1": 123, "1:10": 4212345}
    link = LinkShaping(10 ** 8, (5001, 5002))
    assert shaping.port_bytes(link, counters) == [PortBytes(4212345, 5300), PortBytes(0, 0)]
    assert shaping.report_lines(link, counters) == ["ps:0 link (100mbit): 4.2 MB to it, 5.3 kB from it",
                                                    "ps:1 link (100mbit): 0.0 kB to it, 0.0 kB from it"]


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
