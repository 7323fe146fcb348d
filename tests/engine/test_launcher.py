"""Launcher: port 0 discovery, health, stop frees the port; failures name the log; the SGLang command."""

from __future__ import annotations

import socket
import stat
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from asyncrl.config import EngineConfig
from asyncrl.engine.launcher import (
    EngineLaunchError,
    answers,
    attach,
    launch_embedded,
    launch_sglang,
    sglang_command,
    sglang_dtype,
    sglang_key_config,
)


@pytest.mark.timeout(120)
def test_launch_port_zero_health_and_stop_frees_port(engine_model_dir):
    proc = launch_embedded(engine_model_dir, port=0, threads=1, weight_version=2, startup_timeout_s=120)
    scratch = Path(proc.log_path).parent  # no log_dir given: a temporary directory of this launch
    try:
        assert scratch.is_dir() and scratch.name.startswith("asyncrl-engine-")
        port = int(proc.url.rsplit(":", 1)[1])
        assert port > 0 and proc.alive() and isinstance(proc.pid, int)
        assert httpx.get(proc.url + "/health").json() == {"status": "ok"}
        assert httpx.get(proc.url + "/model_info").json()["weight_version"] == "2"
    finally:
        proc.stop()
    assert not proc.alive() and proc.proc.returncode is not None
    assert not scratch.exists()  # removed with the process: repeated launches leave nothing in /tmp
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    proc.stop()  # idempotent


@pytest.mark.timeout(60)
def test_launch_failures_are_loud_and_leave_no_temp_dir(tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the launcher's scratch dir goes
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(EngineLaunchError, match="not a Hugging Face checkpoint"):
        launch_embedded(model)
    (model / "config.json").write_text("{}")  # a checkpoint that cannot load: the process exits
    with pytest.raises(EngineLaunchError, match="exited with code") as e:
        launch_embedded(model, startup_timeout_s=60)
    assert "server.log" in str(e.value) and "model_type" in str(e.value)  # the log's tail is in the error
    assert list(temp.iterdir()) == []  # the scratch dir of port file and log went with the failed launch


def test_sglang_command_flags():
    engine = EngineConfig(type="sglang", host="127.0.0.1", dtype="bfloat16", mem_fraction_static=0.5, extra_args=["--tp", "1"])
    cmd = sglang_command("/m", engine, 30000, weight_version=3, extra_args=["--config", "/k.yaml"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model-path"] == "/m" and flags["--port"] == "30000" and flags["--dtype"] == "bfloat16"
    assert flags["--mem-fraction-static"] == "0.5" and flags["--weight-version"] == "3"
    assert flags["--host"] == "127.0.0.1" and cmd[-4:] == ["--tp", "1", "--config", "/k.yaml"]


def test_sglang_gets_its_keys_from_a_private_file_not_argv(tmp_path):
    """SGLang reads keys only from its arguments: the token goes in a 0600 YAML file named by --config."""
    token = "k" * 43
    local, exposed = tmp_path / "local", tmp_path / "exposed"
    local.mkdir(), exposed.mkdir()
    path = sglang_key_config(local, "127.0.0.1", token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"admin-api-key": token}  # control routes only: /generate open
    assert yaml.safe_load(sglang_key_config(exposed, "0.0.0.0", token).read_text()) == {
        "admin-api-key": token, "api-key": token}  # beyond loopback every route but /health
    for flag in ("--api-key", "--admin-api-key=secret-value", "--config"):
        with pytest.raises(EngineLaunchError, match="engine.extra_args") as e:
            launch_sglang("/m", extra_args=["--tp", "1", flag, "x"])
        assert "secret-value" not in str(e.value)


def test_auto_dtype_reaches_sglang_as_bf16_and_a_restart_keeps_the_version():
    """asyncrl's `auto` means bf16 on a GPU; SGLang's own `auto` would serve an fp32 checkpoint in fp16."""
    flags = dict(zip(*(lambda c: (c[3::2], c[4::2]))(sglang_command("/m", EngineConfig(dtype="auto"), 1, weight_version=7))))
    assert flags["--dtype"] == "bfloat16" and flags["--weight-version"] == "7"
    assert [sglang_dtype(d) for d in ("float32", "float16", "bfloat16")] == ["float32", "float16", "bfloat16"]
    for bad in ("half", "fp8", ""):
        with pytest.raises(EngineLaunchError, match=repr(bad)):
            sglang_dtype(bad)


@pytest.mark.timeout(60)
async def test_liveness_probe_does_not_blame_a_paused_engine(engine):
    """SGLang's /health generates a token (503 while paused); liveness reads /model_info instead."""
    from tests.engine.conftest import post

    await post(engine.url, "/pause_generation", {"mode": "in_place"})
    try:
        assert answers(engine.url)
        assert [p.url for p in attach([engine.url], timeout_s=5)] == [engine.url]
    finally:
        await post(engine.url, "/continue_generation", {})
    assert not answers("http://127.0.0.1:9", timeout=1.0)


@pytest.mark.timeout(180)
def test_engine_exits_when_its_launcher_is_killed(engine_model_dir):
    """A launcher SIGKILLed (as a crashed Ray actor is) must not leave its engine running on a port."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = ("import sys, time\nfrom asyncrl.engine.launcher import launch_embedded\n"
              f"p = launch_embedded({str(engine_model_dir)!r}, threads=1, startup_timeout_s=120)\n"
              "print(p.pid, p.url, p.log_path, flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine_pid, url, log_path = launcher.stdout.readline().split()
    engine_pid = int(engine_pid)
    assert httpx.get(url + "/health").status_code == 200
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)  # still there (possibly a zombie awaiting its new parent)
        except ProcessLookupError:
            break
        with open(f"/proc/{engine_pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                break
        time.sleep(0.2)
    else:
        os.kill(engine_pid, signal.SIGKILL)
        pytest.fail(f"engine pid {engine_pid} outlived its SIGKILLed launcher by 30 s")
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
    scratch = os.path.dirname(log_path)  # the launcher's temp dir (port file, log): the orphan removed it
    assert os.path.basename(scratch).startswith("asyncrl-engine-") and not os.path.exists(scratch)


@pytest.mark.timeout(180)
def test_launch_configured_gives_the_engine_every_setting_of_the_config(engine_model_dir, tmp_path):
    """The run's `engine` section reaches the engine process whole: what the server reports serving with is
    what the config said (each value off its default), and a prompt over the configured max_running_tokens
    gets the engine's 400, where the default 16384 would have served it."""
    from asyncrl.config import EngineConfig, load_config
    from asyncrl.engine.launcher import launch_configured
    from asyncrl.util.net import free_port

    cfg = load_config(["engine.max_running_tokens=96", "engine.max_running_seqs=3", "engine.device=cpu",
                       "engine.dtype=float32", "agent.max_prompt_tokens=48", "agent.max_response_tokens=48",
                       f"trainer.output_dir={tmp_path / 'run'}"])
    default = EngineConfig()
    assert (cfg.engine.max_running_tokens, cfg.engine.max_running_seqs) != (default.max_running_tokens,
                                                                           default.max_running_seqs)
    proc = launch_configured(cfg, str(engine_model_dir), port=free_port("127.0.0.1"), threads=1,
                             log_dir=str(tmp_path / "engines"))
    try:
        info = httpx.get(proc.url + "/server_info", timeout=30).json()
        assert {k: info[k] for k in ("device", "dtype", "max_running_seqs", "max_running_tokens")} == {
            "device": "cpu", "dtype": "float32", "max_running_seqs": 3, "max_running_tokens": 96}

        def generate(n: int) -> httpx.Response:
            body = {"input_ids": list(range(300, 300 + n)), "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
            return httpx.post(proc.url + "/generate", json=body, timeout=60)

        assert generate(96).status_code == 200
        over = generate(97)
        assert over.status_code == 400, over.text
        assert over.json() == {"error": "input_ids has 97 tokens, more than max_running_tokens=96"}
    finally:
        proc.stop()
