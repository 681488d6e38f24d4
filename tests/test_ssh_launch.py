

@pytest.mark.timeout(600)
def test_injected_kill_restarts_the_task_over_a_new_connection(sshd, tmp_path):
    spec = _spec(tmp_path, mode="sync", max_steps=200)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--no_live", "--max_restarts", "1",
                        "--restart_backoff_secs", "0.5", "--inject", "kill:worker:1@step=60"], cwd=tmp_path,
                       timeout=420, command="ssh")
    out = run.output
    assert run.returncode == 0, out[-4000:]
    assert "restarting worker:1 (restart 1: injected kill:worker:1@step=60)" in out, out[-3000:]
    assert checkpoint_step(tmp_path / "train") == 200
    _wait_gone(str(tmp_path / "train"))


@pytest.mark.timeout(600)
def test_a_failed_task_stops_the_others_on_every_host(sshd, tmp_path):
    spec = _spec(tmp_path, max_steps=1_000_000)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--no_live", "--max_restarts", "1",
                        "--inject", "exit:worker:1@step=50,code=3"], cwd=tmp_path, timeout=420, command="ssh")
    assert run.returncode == 3, run.output[-4000:]
    assert "worker:1" in run.output.split("psworker: error")[0][-2000:] or "worker:1 failed" in run.output
    assert "closing their connections" not in run.output, run.output[-3000:]
    _wait_gone(str(tmp_path / "train"))
