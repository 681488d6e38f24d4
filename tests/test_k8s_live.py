"""`psworker k8s apply|status|logs|delete` against a real cluster, run only where one is configured.

The cluster tests need KUBECONFIG set to a reachable cluster (and the `k8s` extra); they skip with the reason
otherwise. Optional: PSWORKER_TEST_IMAGE (an image with psworker installed; default python:3.11-slim, whose pods
fail at once, which is enough for apply/status/delete), PSWORKER_TEST_NAMESPACE (default `default`).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def psworker(*args: str, env=None, code: str = "") -> subprocess.CompletedProcess:
    prelude = f"{code or 'pass'}; from psworker.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", f"import sys; {prelude}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_missing_client_names_the_extra():
    r = psworker("k8s", "status", "run1", code="sys.modules['kubernetes'] = None")   # as if not installed
    assert r.returncode == 2 and "pip install 'psworker[k8s]'" in r.stderr and "Traceback" not in r.stderr


def test_no_cluster_configured_is_a_clear_error(tmp_path):
    pytest.importorskip("kubernetes", reason="the k8s extra is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    env.update(KUBECONFIG=str(tmp_path / "none"), HOME=str(tmp_path))
    r = psworker("k8s", "delete", "run1", env=env)
    assert r.returncode == 2 and "no Kubernetes cluster configured" in r.stderr and "Traceback" not in r.stderr


def _no_cluster_reason():
    if not os.environ.get("KUBECONFIG"):
        return "no cluster: KUBECONFIG is not set"
    try:
        import kubernetes
    except ImportError:
        return "the k8s extra (kubernetes client) is not installed"
    try:
        kubernetes.config.load_kube_config()
        kubernetes.client.VersionApi().get_code(_request_timeout=5)
    except Exception as e:  # any failure to reach the API server
        return f"KUBECONFIG's cluster is not reachable: {e}"
    return None


@pytest.mark.skipif(_no_cluster_reason() is not None, reason=str(_no_cluster_reason()))
def test_apply_status_delete_on_a_real_cluster(tmp_path):
    name = f"psw-test-{uuid.uuid4().hex[:6]}"
    ns = os.environ.get("PSWORKER_TEST_NAMESPACE", "default")
    image = os.environ.get("PSWORKER_TEST_IMAGE", "python:3.11-slim")
    manifest = tmp_path / "run.yaml"
    r = psworker("k8s", "manifest", str(ROOT / "cluster_specs" / "two-ps.yaml"), "--image", image, "--name", name,
                 "--namespace", ns, "--max_steps", "20", "-o", str(manifest))
    assert r.returncode == 0, r.stderr
    try:
        r = psworker("k8s", "apply", str(manifest))
        assert r.returncode == 0, r.stderr
        assert f"applied Job/{name}-worker" in r.stdout and f"applied NetworkPolicy/{name}-grpc" in r.stdout
        deadline, tasks = time.monotonic() + 90, set()
        while time.monotonic() < deadline and len(tasks) < 5:
            r = psworker("k8s", "status", name, "--namespace", ns)
            assert r.returncode == 0, r.stderr
            tasks = {line.split()[0] for line in r.stdout.splitlines()[1:] if line.strip()}
            time.sleep(2)
        assert {"ps:0", "ps:1", "worker:0", "worker:1", "worker:2"} <= tasks
    finally:
        r = psworker("k8s", "delete", name, "--namespace", ns)
    assert r.returncode == 0 and f"deleted Job/{name}-ps" in r.stdout and f"deleted Service/{name}" in r.stdout


def test_unreachable_cluster_is_a_clear_error(tmp_path):
    pytest.importorskip("kubernetes", reason="the k8s extra is not installed")
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\ncurrent-context: x\n"
                      "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"   # discard port: refused
                      "users: [{name: u, user: {token: t}}]\n"
                      "contexts: [{name: x, context: {cluster: c, user: u}}]\n")
    r = psworker("k8s", "status", "run1", env={**os.environ, "KUBECONFIG": str(config)})
    assert r.returncode == 1 and "cannot reach the Kubernetes API server" in r.stderr and "Traceback" not in r.stderr
