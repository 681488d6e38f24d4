"""A real Prometheus server (Debian's `prometheus` package, installed by `.ci/run`) in a temporary directory, for
tests: its own config and storage, on a free loopback port, scraping every second the targets a test names in a
file (`file_sd_configs`: Prometheus reads a new targets file at once), queried through its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from psworker.launcher.ports import pick_free_ports

START_TIMEOUT_SECS = 60.0
SCRAPE_SECS = 1.0


def why_no_prometheus() -> Optional[str]:
    """None when this machine has the prometheus and promtool commands, else the reason (for pytest.skip)."""
    missing = [name for name in ("prometheus", "promtool") if shutil.which(name) is None]
    return None if not missing else (f"prometheus not installed (missing {', '.join(missing)}); .ci/run installs "
                                     "Debian's prometheus package")


class Prometheus:
    """`prometheus` on 127.0.0.1 with a 1 s scrape interval; `add_targets` names what it scrapes; `close()` stops
    it (SIGTERM, then SIGKILL) and nothing of it is left."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "targets").mkdir(parents=True, exist_ok=True)
        self.port = pick_free_ports(1)[0]
        config = {"global": {"scrape_interval": f"{SCRAPE_SECS:g}s", "scrape_timeout": f"{SCRAPE_SECS:g}s",
                             "evaluation_interval": f"{SCRAPE_SECS:g}s"},
                  "scrape_configs": [{"job_name": "psworker",
                                      "file_sd_configs": [{"files": [str(self.root / "targets" / "*.json")],
                                                           "refresh_interval": "1s"}]}]}
        (self.root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = open(self.root / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.root / 'prometheus.yml'}", f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(lambda: self._get("/-/ready", raw=True) is not None, "prometheus ready", START_TIMEOUT_SECS)
        except BaseException:
            self.close()
            raise

    def add_targets(self, name: str, addresses: Sequence[str], **labels: str) -> None:
        """Scrapes `addresses` (`host:port`) from now on, each with `labels` (e.g. run="a")."""
        path = self.root / "targets" / f"{name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": list(addresses), "labels": labels}]))
        tmp.rename(path)

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (`[{"metric": {...}, "value": [t, "v"]}, ...]`)."""
        return self._api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = SCRAPE_SECS) -> list[dict]:
        """A range query's result matrix (`[{"metric": {...}, "values": [[t, "v"], ...]}, ...]`)."""
        return self._api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]

    def series(self, match: str, start: float) -> list[dict]:
        """Every series (its label set, `__name__` included) matching `match` since `start`."""
        return self._api("series", **{"match[]": match, "start": f"{start:.3f}"})

    def value(self, expr: str) -> Optional[float]:
        """The one value of an instant query (None: an empty result)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {len(result)} series: {result}"
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, expr: str, want: Callable[[Optional[float]], bool], what: str, timeout: float) -> float:
        """Waits until `want(value(expr))`; returns that value."""
        seen: list[Optional[float]] = []

        def ready() -> bool:
            seen.append(self.value(expr))
            return want(seen[-1])
        self._wait(ready, f"{what} ({expr}; last value {seen[-1] if seen else None})", timeout)
        return seen[-1]

    def targets_up(self) -> list[tuple[str, str]]:
        """(scrape URL, health) of every active target."""
        return [(t["scrapeUrl"], t["health"]) for t in self._api("targets")["activeTargets"]]

    def _api(self, path: str, **params: str) -> Any:
        body = self._get(f"/api/v1/{path}?{urllib.parse.urlencode(params)}")
        assert body is not None and body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def _get(self, path: str, raw: bool = False) -> Any:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        return text if raw else json.loads(text)

    def _wait(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}) waiting for {what}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout:g} s; prometheus log: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self) -> str:
        return (self.root / "prometheus.log").read_text(errors="replace")[-2000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()
