"""SGLang 0.5's weight-update endpoints, as an APIRouter any EngineCore-shaped server mounts:

    POST /init_weights_update_group        {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /destroy_weights_update_group     {group_name}
    POST /begin_weight_update              {}  opens the session (a second begin is refused)
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache, weight_version, load_format}
    POST /update_weights_from_tensor       {serialized_named_tensors (one per TP rank), load_format, flush_cache, weight_version}
    POST /end_weight_update                {}  closes it (refused when none is open)
    POST /update_weights_from_disk         {model_path, weight_version, flush_cache, load_format}  (no session)
    GET|POST /get_weights_by_name          {name, truncate_size=100}: a bare JSON list, the tensor as float32
                                           cut to its first truncate_size rows; HTTP 400 {"error": {"message":
                                           "Get parameter by name failed"}} for a name the model does not hold
Answers: HTTP 200 {"success": true, "message"}; HTTP 400 {"success": false, "message"} when the
engine refuses (outside a session, no such group, a tensor the model does not have: "Failed to
update parameter online: ..."); HTTP 400 with an error object and no "success" for a malformed
request. /update_weights_from_disk adds "num_paused_requests". weight_version is a string.

Who may call them: the server this router is mounted on (asyncrl/engine/server.py) puts the token
gate (asyncrl/util/auth.py) in front of every POST here; /update_weights_from_disk reads only below
`weights_roots` (HTTP 403 otherwise), and /update_weights_from_tensor unpickles with the tensor-only
unpickler (safe_unpickle.py).

Extensions a real SGLang lacks (the sender asks GET /weight_sync_info and uses them only when every
engine offers them):
    GET  /weight_sync_info                 {"asyncrl": true, "coalesce": true, "delta": true, "groups": [...], "session_open",
                                            "weight_version", "dtype" (the served parameters': a sender casts floating
                                            tensors to it), "delta_base" (delta.py: the sync these weights equal, or null)}
    init_weights_update_group {timeout_s}; update_weights_from_distributed {asyncrl_coalesce: true,
                                           asyncrl_track: token, asyncrl_delta: {base, counts, checksums}} (delta.py)
    POST /weight_sync_probe_broadcast      {group_name, numel, dtype}  (benchmark ceiling only)
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from asyncrl.weight_sync.bucketing import dtype_name
from asyncrl.weight_sync.receiver import CAPABILITIES, Answer, WeightReceiver, invalid


async def _body(request: Request) -> dict | Answer:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return invalid(f"malformed JSON body: {e}")
    return body if isinstance(body, dict) else invalid(f"body must be a JSON object, got {type(body).__name__}")


def make_router(core: Any, weights_roots: Sequence[str | os.PathLike] = ()) -> APIRouter:
    """The routes over `core`; disk loads only from below `weights_roots` (none: every one refused)."""
    receiver = WeightReceiver(core, weights_roots)
    router = APIRouter()

    def handler(method: Callable[[dict], Awaitable[Answer]]):
        async def endpoint(request: Request) -> JSONResponse:
            body = await _body(request)
            answer = body if isinstance(body, Answer) else await method(body)
            return JSONResponse(answer.body, status_code=answer.status)
        return endpoint

    for path, method in [
        ("/init_weights_update_group", receiver.init_group),
        ("/destroy_weights_update_group", receiver.destroy_group),
        ("/begin_weight_update", receiver.begin),
        ("/end_weight_update", receiver.end),
        ("/update_weights_from_distributed", receiver.update_from_distributed),
        ("/update_weights_from_tensor", receiver.update_from_tensor),
        ("/update_weights_from_disk", receiver.update_from_disk),
        ("/weight_sync_probe_broadcast", receiver.probe_broadcast),
    ]:
        router.add_api_route(path, handler(method), methods=["POST"])

    @router.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def weights_by_name(request: Request) -> JSONResponse:
        body = await _body(request)
        if isinstance(body, Answer):
            return JSONResponse(body.body, status_code=body.status)
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            bad = invalid(f"get_weights_by_name needs name (a string) and truncate_size (an int >= 0), got "
                          f"{name!r:.80}, {size!r:.40}")
            return JSONResponse(bad.body, status_code=bad.status)
        t = core.model.state_dict().get(name)
        if t is None:
            return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)
        t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
        return JSONResponse(t[:size].float().cpu().tolist())

    @router.get("/weight_sync_info")
    async def info() -> dict:
        return {**CAPABILITIES, "weight_version": str(core.weight_version), "groups": sorted(receiver.groups),
                "session_open": receiver.session_open, "delta_base": receiver.delta_base,
                "dtype": dtype_name(next(core.model.parameters()).dtype)}

    router.receiver = receiver  # type: ignore[attr-defined] - for tests and introspection
    return router
