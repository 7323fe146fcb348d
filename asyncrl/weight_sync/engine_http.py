"""HTTP calls from the sender to the engines, each answer classified by status and structure.

SGLang 0.5 answers a weight-update call with HTTP 200 {"success": true, "message"} or HTTP 400
{"success": false, "message"}; a request it cannot parse gets HTTP 400 with an error object and no
"success" key; a broken or stopping server answers 5xx. `classify` turns that into a WeightSyncError
code (errors.py) without reading the message.

Every call carries the run's token (`Authorization: Bearer`, from ASYNCRL_ENGINE_TOKEN, as SGLang's
--admin-api-key expects it). An engine that refuses it (401, or 403: the embedded engine without a
token) is a `config` error whose message says which side lacks the token.

PROBE_TIMEOUT_S is the one default of a probe's timeout (a GET /model_info, a group teardown): the
sender's and EngineHTTP's. The sync's own timeout defaults to the config's
(asyncrl.config.WeightSyncConfig.timeout_s), read by every constructor that takes one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from asyncrl.util.auth import ENV, auth_headers
from asyncrl.weight_sync.errors import FLUSH_REFUSED, WeightSyncError

PROBE_TIMEOUT_S = 5.0  # a probe of an engine (GET /model_info and the like): the default everywhere


def classify(url: str, path: str, status: int, data: Any) -> WeightSyncError | None:
    """None for a success, else the error an answer of `status` with JSON `data` means."""
    sglang_shaped = isinstance(data, dict) and isinstance(data.get("success"), bool)
    if 200 <= status < 300 and not (sglang_shaped and data["success"] is False):
        return None
    message = f"{path}: HTTP {status}: {_message(data)}"
    if status in (401, 403):
        held = "this process holds one" if auth_headers() else "this process holds none"
        message += (f" (the engine's control routes need the run's token, {ENV}, as SGLang's --admin-api-key; "
                    f"{held}: an engine attached with engine.urls must be started with the same token)")
    if status >= 500:
        return WeightSyncError("unreachable", message, url, status)
    if sglang_shaped and str(data.get("message", "")).startswith(FLUSH_REFUSED):  # loaded, not flushed
        return WeightSyncError("flush_refused", message, url, status)
    if sglang_shaped and data.get("asyncrl_delta_mismatch") is True:  # delta.py: the next sync is full
        return WeightSyncError("delta_mismatch", message, url, status)
    if sglang_shaped:  # 400 (or a 200 from an older server) with success=false: the engine said no
        return WeightSyncError("refused", message, url, status)
    return WeightSyncError("config", message, url, status)


def _message(data: Any) -> str:
    if isinstance(data, dict):
        m = data.get("message") or data.get("error") or data.get("detail") or data
        return str(m.get("message", m) if isinstance(m, dict) else m)[:2000]
    return str(data)[:2000]


class EngineHTTP:
    """Calls to a set of engines; a failure is returned as a WeightSyncError, never raised."""

    def __init__(self, probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.client = httpx.AsyncClient(timeout=None, trust_env=False, headers=auth_headers())
        self.probe_timeout_s = float(probe_timeout_s)

    async def call(self, method: str, url: str, path: str, body: dict | None = None,
                   timeout: float | None = None) -> tuple[Any, WeightSyncError | None]:
        """(JSON answer, None) or (answer or None, the error)."""
        try:
            r = await self.client.request(method, url.rstrip("/") + path, json=body, timeout=timeout)
        except httpx.TimeoutException as e:
            return None, WeightSyncError("timeout", f"{path}: no answer within {timeout}s ({type(e).__name__})", url)
        except (httpx.HTTPError, OSError) as e:
            return None, WeightSyncError("unreachable", f"{path}: {type(e).__name__}: {e}", url)
        try:
            data = r.json()
        except ValueError:
            data = r.text[:2000]
        return data, classify(url, path, r.status_code, data)

    async def post(self, url: str, path: str, body: dict, timeout: float | None) -> WeightSyncError | None:
        return (await self.call("POST", url, path, body, timeout))[1]

    async def post_all(self, urls: list[str], path: str, body: dict, timeout: float | None) -> dict[str, WeightSyncError]:
        """{url: error} for the engines whose call failed."""
        errs = await asyncio.gather(*(self.post(u, path, body, timeout) for u in urls))
        return {u: e for u, e in zip(urls, errs) if e is not None}

    async def get(self, url: str, path: str) -> tuple[Any, WeightSyncError | None]:
        return await self.call("GET", url, path, None, self.probe_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()
