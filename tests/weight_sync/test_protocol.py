"""The sender's reading of engine answers: codes by HTTP status and reply structure, never wording;
and the protocol's refusals of a bad setup. No engine needed: a real HTTP server answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync import WeightMismatchError, WeightSender, WeightSyncError, make_sender
from asyncrl.weight_sync.broadcast import GroupTransport
from asyncrl.weight_sync.disk import DiskTransport
from asyncrl.weight_sync.engine_http import EngineHTTP, classify


@pytest.mark.parametrize("status,data,code", [
    (200, {"success": True, "message": "Success"}, None),
    (200, {"model_path": "m", "weight_version": "3"}, None),  # GET answers carry no "success"
    (400, {"success": False, "message": "Failed to receive weights: anything at all"}, "refused"),
    (400, {"success": False, "message": ""}, "refused"),
    (200, {"success": False, "message": "older servers said no with a 200"}, "refused"),
    (400, {"object": "error", "message": "weight 'x' is not a tensor", "type": "Bad Request", "code": 400}, "config"),
    (404, {"detail": "Not Found"}, "config"),
    (422, "not json", "config"),
    (503, "", "unreachable"),
    (500, {"success": False, "message": "weight 'x'"}, "unreachable"),
])
def test_answers_are_classified_by_status_and_structure(status, data, code):
    err = classify("http://e:1", "/p", status, data)
    assert (err.code if err else None) == code
    if err:
        assert err.url == "http://e:1" and err.status == status and "/p: HTTP" in err.message


def test_a_refused_flush_is_told_from_a_refused_load_by_sglangs_message():
    flush = {"success": False, "message": "Weights were updated, but the cache was not flushed because requests "
             "are still running or queued. Retract or finish them, then call /flush_cache."}
    err = classify("http://e:1", "/update_weights_from_distributed", 400, flush)
    assert err.code == "flush_refused" and err.left_out and not err.engine_is_down
    load = {"success": False, "message": "Failed to update parameter online: ... Weights were updated, but"}
    assert classify("http://e:1", "/p", 400, load).code == "refused"
    assert not classify("http://e:1", "/p", 400, load).left_out


@pytest.mark.parametrize("info,config,want", [
    ({"dtype": "bfloat16"}, None, torch.bfloat16), ({"dtype": "half"}, None, torch.float16),
    ({"dtype": "float"}, None, torch.float32), ({"dtype": "fp8"}, None, None), ({}, None, None),
    ({"dtype": "auto"}, {"torch_dtype": "bfloat16"}, torch.bfloat16),
    ({"dtype": "auto"}, {"dtype": "float32"}, torch.float16),  # SGLang serves an fp32 checkpoint in fp16
    ({"dtype": "auto"}, {"model_type": "gemma2"}, torch.bfloat16),  # ... a Gemma one in bf16
    ({"dtype": "auto"}, "not json", None), ({"dtype": "auto"}, "missing", None),
])
def test_the_dtype_sglang_serves_follows_its_own_rule(info, config, want, tmp_path):
    from asyncrl.models import sglang_served_dtype, torch_dtype

    if config is not None:
        info = {**info, "model_path": str(tmp_path)}
        if config != "missing":
            (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    name = sglang_served_dtype(info.get("dtype"), info.get("model_path"))
    assert (torch_dtype(name) if name else None) == want


def test_error_codes_are_closed_and_mismatch_is_a_refusal():
    with pytest.raises(ValueError, match="'gone' is not one of"):
        WeightSyncError("gone", "x")
    e = WeightMismatchError("Failed to update parameter online: weight 'a'", "http://e:1", 400)
    assert isinstance(e, WeightSyncError) and e.code == "refused" and not e.engine_is_down
    assert WeightSyncError("timeout", "x").engine_is_down and WeightSyncError("unreachable", "x").engine_is_down
    assert all(WeightSyncError(c, "x").left_out for c in ("timeout", "unreachable", "flush_refused"))


def _send_json(handler: BaseHTTPRequestHandler, status: int, body: object) -> None:
    raw = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


class _Scripted(BaseHTTPRequestHandler):
    """Answers every request with the status and body scripted for its path."""

    script: dict[str, tuple[int, object]] = {}

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        status, body = self.script.get(self.path, (404, {"detail": "Not Found"}))
        _send_json(self, status, body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def scripted():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_real_http_answers_become_codes(scripted):
    server, url = scripted
    _Scripted.script = {"/a": (400, {"success": False, "message": "whatever words"}), "/b": (200, {"success": True})}
    http = EngineHTTP(2.0)
    try:
        assert (await http.post(url, "/a", {}, 5)).code == "refused"
        assert await http.post(url, "/b", {}, 5) is None
        assert (await http.post(url, "/missing", {}, 5)).code == "config"
        assert (await http.post("http://127.0.0.1:1", "/a", {}, 5)).code == "unreachable"
    finally:
        await http.aclose()


async def test_disk_update_refused_by_status_raises_mismatch_and_continues(scripted, tmp_path):
    """An engine that answers 400 success=false to the load: WeightMismatchError; the engine was
    paused, so it is told to continue anyway; no session (SGLang loads from disk without one)."""
    import torch

    server, url = scripted
    calls: list[str] = []
    _Scripted.script = {"/model_info": (200, {"weight_version": "0"}), "/pause_generation": (200, {"success": True}),
                        "/continue_generation": (200, {"success": True}), "/get_weights_by_name": (200, [0.0, 0.0]),
                        "/update_weights_from_disk": (400, {"success": False, "message": "no", "num_paused_requests": 0})}
    orig = _Scripted._answer

    def recording(self):
        calls.append(self.path)
        orig(self)

    _Scripted.do_GET = _Scripted.do_POST = recording
    sender = WeightSender(DiskTransport(str(tmp_path)), timeout_s=10)
    try:
        await sender.connect([url])
        with pytest.raises(WeightMismatchError) as err:
            await sender.sync(iter([[("w", torch.zeros(2))]]), version=4)
    finally:
        _Scripted.do_GET = _Scripted.do_POST = orig
        await sender.close()
    assert err.value.url == url and err.value.status == 400
    assert calls == ["/model_info", "/model_info", "/pause_generation", "/get_weights_by_name", "/update_weights_from_disk",
                     "/continue_generation"]
    assert (tmp_path / "v4" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("kwargs,needle", [({"mode": "sometimes"}, "mode 'sometimes'"), ({"timeout_s": 0}, "timeout_s"),
                                           ({"verify_every": -1}, "verify_every must be >= 0")])
def test_bad_sender_settings_are_config_errors(kwargs, needle, tmp_path):
    with pytest.raises(WeightSyncError, match=needle) as err:
        WeightSender(DiskTransport(str(tmp_path)), **kwargs)
    assert err.value.code == "config"


async def test_sync_before_connect_and_connect_without_engines_are_config_errors(tmp_path):
    sender = WeightSender(DiskTransport(str(tmp_path)))
    try:
        with pytest.raises(WeightSyncError, match="before connect") as err:
            await sender.sync(iter([]), 1)
        assert err.value.code == "config"
        with pytest.raises(WeightSyncError, match="no engine urls"):
            await sender.connect([])
    finally:
        await sender.close()


def test_the_one_factory_rejects_an_unknown_transport():
    with pytest.raises(WeightSyncError, match="transport='carrier-pigeon'") as err:
        make_sender(WeightSyncConfig(transport="carrier-pigeon"), rank=0, engine_urls=["http://127.0.0.1:1"])  # type: ignore[arg-type]
    assert err.value.code == "config"


async def test_every_tp_rank_joins_the_group_and_a_paused_engine_is_not_blamed(tmp_path):
    """Two SGLang-shaped servers with tp_size 2 and 3, whose /health answers 503 (paused SGLang):
    the probe is /model_info, world_size counts every TP rank and rank_offsets follow them. The
    servers refuse to join, so the group is not built and both are left out (reported, not raised)."""
    bodies: list[dict] = []

    def server_with(tp: int):
        class H(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                status, reply = {
                    "/health": (503, ""), "/model_info": (200, {"weight_version": "0"}),
                    "/server_info": (200, {"tp_size": tp}),
                    "/init_weights_update_group": (400, {"success": False, "message": "not today"}),
                }.get(self.path, (404, {"detail": "Not Found"}))
                if self.path == "/init_weights_update_group":
                    bodies.append(body)
                _send_json(self, status, reply)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        s = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        return s

    servers = [server_with(2), server_with(3)]
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    sender = WeightSender(GroupTransport("gloo", timeout_s=2), timeout_s=2)
    try:
        live, dead = await sender.probe(urls)
        assert live == urls and dead == {}
        left_out = await sender.connect(urls)
    finally:
        await sender.close()
        for s in servers:
            s.shutdown()
            s.server_close()
    assert set(left_out) == set(urls) and all(e.code == "refused" for e in left_out.values())
    assert sorted((b["rank_offset"], b["world_size"]) for b in bodies) == [(1, 6), (3, 6)]
    assert all(b["backend"] == "gloo" and "timeout_s" not in b for b in bodies)  # no extension for SGLang
