"""SGLang's weight-update endpoints, as an APIRouter any EngineCore-shaped server mounts:

    POST /init_weights_update_group        {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache, weight_version}
    POST /update_weights_from_tensor       {serialized_named_tensors, load_format, flush_cache, weight_version}
    POST /destroy_weights_update_group     {group_name}
and two asyncrl additions a real SGLang lacks (the sender probes for them and falls back):
    GET  /weight_sync_info                 {"asyncrl": true, "coalesce": true, "tp_size": 1}
    POST /weight_sync_probe_broadcast      {group_name, numel, dtype}  (benchmark ceiling only)
Replies: {"success": bool, "message": str, "weight_version": int}; a failure is HTTP 200 with
success=false, as SGLang does. Pause/continue and /update_weights_from_disk belong to the server.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from asyncrl.weight_sync.receiver import CAPABILITIES, WeightReceiver


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {"__error__": f"malformed JSON body: {e}"}
    return body if isinstance(body, dict) else {"__error__": f"body must be a JSON object, got {type(body).__name__}"}


def make_router(core: Any) -> APIRouter:
    receiver = WeightReceiver(core)
    router = APIRouter()

    def handler(method):
        async def endpoint(request: Request) -> dict:
            body = await _body(request)
            if "__error__" in body:
                return {"success": False, "message": body["__error__"], "weight_version": int(core.weight_version)}
            return await method(body)
        return endpoint

    router.add_api_route("/init_weights_update_group", handler(receiver.init_group), methods=["POST"])
    router.add_api_route("/update_weights_from_distributed", handler(receiver.update_from_distributed), methods=["POST"])
    router.add_api_route("/update_weights_from_tensor", handler(receiver.update_from_tensor), methods=["POST"])
    router.add_api_route("/destroy_weights_update_group", handler(receiver.destroy_group), methods=["POST"])
    router.add_api_route("/weight_sync_probe_broadcast", handler(receiver.probe_broadcast), methods=["POST"])

    @router.get("/weight_sync_info")
    async def info() -> dict:
        return {**CAPABILITIES, "weight_version": int(core.weight_version), "groups": sorted(receiver.groups)}

    router.receiver = receiver  # type: ignore[attr-defined] - for tests and introspection
    return router
