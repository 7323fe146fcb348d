"""The engine's control surface needs the run's token (asyncrl/util/auth.py, docs/design.md "Threat
model"): hostile callers on a real embedded engine (tiny model, real socket) are refused and change
nothing; pickles that would run code are refused even with the token; disk loads stay inside the
engine's weight roots; a non-loopback bind without a token never serves."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import pickle
import shutil
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import httpx
import pytest
import torch

from asyncrl.engine.launcher import answers, launch_embedded
from asyncrl.run.engine_watch import paused, probe
from asyncrl.util.auth import (
    ENV,
    TokenError,
    auth_headers,
    bearer_matches,
    check_bind,
    ensure_token,
    make_token,
    token_from_env,
)
from asyncrl.util.net import is_loopback
from asyncrl.weight_sync import WeightSender, WeightSyncError
from asyncrl.weight_sync.disk import DiskTransport
from asyncrl.weight_sync.safe_unpickle import UnsafePayload, load_named_tensors
from tests.engine.conftest import build_untied, post

PROMPT = list(range(300, 316))
GREEDY = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8}}
NO_TOKEN: dict[str, str] = {}
WRONG = {"Authorization": "Bearer " + "x" * 43}


class RunsCode:
    """A pickle whose loading runs a shell command (creates `marker`)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def hostile_payload(marker: str) -> str:
    return base64.b64encode(pickle.dumps([("model.norm.weight", RunsCode(marker))])).decode()


async def state(url: str) -> dict:
    """What a refused call must leave as it was: greedy output, version, sessions, groups, pause."""
    async with httpx.AsyncClient(timeout=60) as h:  # no token: generation and info are open on loopback
        gen = (await h.post(url + "/generate", json=GREEDY)).json()
        info = (await h.get(url + "/weight_sync_info")).json()
        return {"output_ids": gen["output_ids"], "version": (await h.get(url + "/model_info")).json()["weight_version"],
                "session_open": info["session_open"], "groups": info["groups"],
                "paused": (await h.get(url + "/stats")).json()["paused"]}


@pytest.fixture(scope="module")
def other_weights(tiny_model_dir, tmp_path_factory):
    """A checkpoint with other weights, outside every engine's roots."""
    return build_untied(tiny_model_dir, tmp_path_factory.mktemp("outside"), seed=7)


def _guarded(model_dir, allowed):
    allowed.mkdir()
    return launch_embedded(model_dir, threads=1, weight_version=5, startup_timeout_s=120, weights_dirs=[allowed])


@pytest.fixture(scope="module")
def shared_guarded(engine_model_dir, tmp_path_factory):
    """One engine for the module's tests (a launch is seconds to tens of seconds on 2 cores), at
    weight_version 5, whose only extra weight root is `allowed`; with its state as launched."""
    allowed = tmp_path_factory.mktemp("roots") / "allowed"
    with _guarded(engine_model_dir, allowed) as proc:
        yield proc, allowed, asyncio.run(state(proc.url))


@pytest.fixture()
def unchanged(shared_guarded):
    """The shared engine, for tests whose hostile calls must change nothing (each checks its state
    first) or that put back what they changed; checked after each test to be as launched."""
    proc, allowed, launched = shared_guarded
    yield proc, allowed
    assert asyncio.run(state(proc.url)) == launched, "a test left the shared engine changed"


# --------------------------------------------------------------------------------------------- helpers

def test_tokens_are_random_and_bad_env_values_are_refused_without_echo(monkeypatch):
    assert make_token() != make_token() and len(make_token()) >= 32
    assert token_from_env({}) is None and token_from_env({ENV: ""}) is None
    for bad in ["short-secret", "has a space in the middle ok", "tab\tinside-the-token-value", "ünïcode-token-value-x"]:
        with pytest.raises(TokenError, match=ENV) as e:
            token_from_env({ENV: bad})
        assert bad not in str(e.value)
    monkeypatch.delenv(ENV, raising=False)
    made = ensure_token()
    assert os.environ[ENV] == made and ensure_token() == made and auth_headers() == {"Authorization": f"Bearer {made}"}


def test_bearer_check_and_loopback_rule():
    t = "t" * 40
    assert bearer_matches(f"Bearer {t}", t) and bearer_matches(f"bearer {t}", t)
    for header in [None, "", t, f"Basic {t}", f"Bearer {t}x", f"Bearer {t[:-1]}", f"Bearer  {t}"]:
        assert not bearer_matches(header, t), header
    assert all(is_loopback(h) for h in ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "::", "10.0.0.5", "example.org", ""])
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", t)
    with pytest.raises(TokenError, match=r"engine\.host.*'0\.0\.0\.0'.*ASYNCRL_ENGINE_TOKEN"):
        check_bind("0.0.0.0", None)


def test_tensor_unpickler_admits_torch_tensors_and_nothing_else(tmp_path):
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.nn.Parameter(torch.ones(2)))]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)  # what the tensor transport sends (here CPU storages, by fd)
    got = load_named_tensors(base64.b64encode(buf.getvalue()).decode())
    assert [n for n, _ in got] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(got, named))

    marker = tmp_path / "pwned"
    for payload, needle in [
        (hostile_payload(str(marker)), "posix.system|os.system"),
        (base64.b64encode(pickle.dumps([("x", eval)])).decode(), "builtins.eval"),
        (base64.b64encode(pickle.dumps({"x": 1})).decode(), "list of \\(name, tensor\\)"),
        (base64.b64encode(pickle.dumps([("x", 3)])).decode(), "list of \\(name, tensor\\)"),
        ("not base64!", "not base64"),
    ]:
        with pytest.raises(UnsafePayload, match=needle):
            load_named_tensors(payload)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------- real engine

CONTROL = [  # every route that changes the engine, each with a body that would succeed with the token
    ("/abort_request", {"abort_all": True}),
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {}),
    ("/begin_weight_update", {}),
    ("/end_weight_update", {}),
    ("/init_weights_update_group", {"master_address": "203.0.113.9", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 2, "group_name": "evil", "backend": "gloo", "timeout_s": 5}),
    ("/destroy_weights_update_group", {"group_name": "evil"}),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                          "group_name": "evil", "weight_version": "99"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "weight_version": "99"}),
    ("/update_weights_from_disk", {"model_path": "WEIGHTS", "weight_version": "99"}),
    ("/weight_sync_probe_broadcast", {"group_name": "evil", "numel": 4}),
]


@pytest.mark.timeout(240)
async def test_control_routes_refuse_callers_without_the_token_and_change_nothing(unchanged, other_weights,
                                                                                  engine_model_dir, tmp_path):
    eng, allowed = unchanged
    inside = shutil.copytree(other_weights, allowed / f"control-{tmp_path.name}")
    before = await state(eng.url)
    assert before["version"] == "5" and not before["paused"] and before["groups"] == []
    marker = tmp_path / "pwned"
    bodies = {path: {**body, "model_path": str(inside)} if "model_path" in body else dict(body) for path, body in CONTROL}
    bodies["/update_weights_from_tensor"]["serialized_named_tensors"] = [hostile_payload(str(marker))]
    for path, body in bodies.items():
        for headers in (NO_TOKEN, WRONG, {"Authorization": "Basic " + "x" * 43}):
            r = await post(eng.url, path, body, headers=headers)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, headers, r.text)
    assert await state(eng.url) == before and not marker.exists()

    # the same disk load with the token does change the engine: the refusals above were the gate's
    try:
        r = await post(eng.url, "/update_weights_from_disk", bodies["/update_weights_from_disk"])
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        after = await state(eng.url)
        assert after["version"] == "99" and after["output_ids"] != before["output_ids"]
    finally:  # the launch weights (the model directory is a weight root) and version back on the shared engine
        r = await post(eng.url, "/update_weights_from_disk", {"model_path": str(engine_model_dir), "weight_version": "5"})
        assert r.status_code == 200 and r.json()["success"] is True, r.text


@pytest.mark.timeout(240)
async def test_pickle_that_runs_code_is_refused_even_with_the_token(unchanged, tmp_path):
    eng, _ = unchanged
    before = await state(eng.url)
    marker = tmp_path / "pwned"
    assert (await post(eng.url, "/begin_weight_update", {})).status_code == 200  # the unpickler runs in a session
    r = await post(eng.url, "/update_weights_from_tensor",
                   {"serialized_named_tensors": [hostile_payload(str(marker))], "weight_version": "99"})
    assert r.status_code == 400 and r.json()["success"] is False and "refused global" in r.json()["message"], r.text
    assert (await post(eng.url, "/end_weight_update", {})).status_code == 200
    assert not marker.exists() and await state(eng.url) == before


@pytest.mark.timeout(240)
async def test_disk_loads_outside_the_weight_roots_are_403(unchanged, other_weights, tmp_path):
    eng, allowed = unchanged
    before = await state(eng.url)
    (allowed / "link").symlink_to(other_weights, target_is_directory=True)
    (allowed / "filelink").mkdir()
    (allowed / "filelink" / "model.safetensors").symlink_to(other_weights / "model.safetensors")
    for path in [other_weights, allowed / "link", allowed / ".." / ".." / other_weights.name,
                 allowed / "filelink", "/etc"]:
        r = await post(eng.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "99"})
        assert r.status_code == 403 and "outside the directories" in r.json()["error"], (path, r.text)
        assert "success" not in r.json()  # the sender reads it as a configuration error, not a refused load
    assert await state(eng.url) == before

    # the sender names the problem: a disk transport writing outside the roots is a config error
    sender = WeightSender(DiskTransport(str(tmp_path / "elsewhere"), timeout_s=60), timeout_s=60)
    await sender.connect([eng.url])
    try:
        with pytest.raises(WeightSyncError) as e:
            await sender.sync([[("model.norm.weight", torch.ones(64))]], version=6)
    finally:
        await sender.close()
    assert e.value.code == "config" and "outside the directories" in e.value.message
    assert await state(eng.url) == before


@pytest.mark.timeout(240)
async def test_a_sender_without_the_token_fails_loudly_and_changes_nothing(unchanged, monkeypatch):
    eng, allowed = unchanged
    before = await state(eng.url)
    monkeypatch.delenv(ENV)
    sender = WeightSender(DiskTransport(str(allowed), timeout_s=60), timeout_s=60)
    await sender.connect([eng.url])  # the probe reads /model_info: open on loopback
    try:
        with pytest.raises(WeightSyncError) as e:
            await sender.sync([[("model.norm.weight", torch.ones(64))]], version=6)
    finally:
        await sender.close()
    assert e.value.code == "config" and e.value.status == 401 and ENV in e.value.message
    assert "holds none" in e.value.message
    assert await state(eng.url) == before


def _serve(model_dir, host: str, env: dict, port_file) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncrl.engine.cli", "serve", "--model-path", str(model_dir), "--host", host,
           "--port", "0", "--port-file", str(port_file), "--threads", "1", "--exit-with-parent", str(os.getpid())]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.timeout(240)
async def test_without_a_token_loopback_serves_generation_only_and_other_hosts_are_refused(engine_model_dir,
                                                                                         tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV}
    exposed = _serve(engine_model_dir, "0.0.0.0", env, tmp_path / "port0")
    out, err = exposed.communicate(timeout=120)
    assert exposed.returncode == 2 and "engine.host" in err and "'0.0.0.0'" in err and ENV in err, err
    assert not (tmp_path / "port0").exists()  # it never bound

    local = _serve(engine_model_dir, "127.0.0.1", env, tmp_path / "port1")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "port1").exists():
            if local.poll() is not None:
                pytest.fail(f"the engine exited with {local.returncode}: {local.communicate()[1][-2000:]}")
            assert time.monotonic() < deadline, "the engine did not announce its port within 120 s"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int((tmp_path / 'port1').read_text())}"
        before = await state(url)
        for path, body in CONTROL:
            r = await post(url, path, body, headers=WRONG)  # no token on the engine: nobody may
            assert r.status_code == 403 and ENV in r.json()["error"], (path, r.text)
        assert await state(url) == before
    finally:
        os.killpg(local.pid, 15)
        local.communicate(timeout=60)


@pytest.mark.timeout(240)
async def test_beyond_loopback_every_route_but_health_needs_the_token(engine_model_dir):
    with launch_embedded(engine_model_dir, host="0.0.0.0", threads=1, startup_timeout_s=120) as eng:
        with open(f"/proc/{eng.pid}/cmdline", "rb") as f:  # readable by every local user: no token there
            assert token_from_env().encode() not in f.read()
        async with httpx.AsyncClient(timeout=60) as h:
            assert (await h.get(eng.url + "/health")).status_code == 200
            for method, path in [("POST", "/generate"), ("GET", "/model_info"), ("GET", "/server_info"),
                                 ("GET", "/stats"), ("GET", "/weight_sync_info"), ("POST", "/pause_generation")]:
                r = await h.request(method, eng.url + path, json=GREEDY if path == "/generate" else {})
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, r.text)
            r = await h.get(eng.url + "/stats", headers=auth_headers())
            assert r.status_code == 200 and r.json()["paused"] is False  # the refused pause changed nothing
            r = await h.post(eng.url + "/generate", json=GREEDY, headers=auth_headers())
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 8
        assert answers(eng.url)  # the launcher's health check carries the token
        assert probe(eng.url, 60.0) is None  # and so does the supervisor's one-token liveness probe
        assert not paused(eng.url)  # answered (with the token), and not paused
