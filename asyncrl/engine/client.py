"""EngineClient: the one async client (httpx) for the embedded engine and SGLang, with a router.

Routing: a request whose `session_id` this client has not seen goes to the engine with the fewest
in-flight requests from this client (ties: the lowest index); later requests of that session go
to the same engine (sticky), so a trajectory's turns share one engine. Sessions are remembered
LRU-bounded (`max_sessions`).

Retries: a connection/transport error or a 5xx reply is retried up to `max_retries` times with
exponential backoff, with the SAME rid (the embedded engine answers a retried rid from the live
or finished request instead of generating twice). 4xx replies raise `EngineRequestError` at once.

Replies without `meta_info.output_token_versions` (real SGLang) get every token's version set
to the reply's `weight_version`. A non-integer SGLang weight_version ("default") reads as 0.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Sequence
from typing import Any, Self

import httpx

from asyncrl.engine.base import GenerateResult, SamplingParams


class EngineRequestError(RuntimeError):
    """An engine answered with an error, or stayed unreachable after the retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def parse_generate_reply(data: dict, engine: str = "") -> GenerateResult:
    """SGLang /generate reply -> GenerateResult (see the module docstring for the version fill)."""
    meta = data.get("meta_info") or {}
    out = list(data.get("output_ids") or [])
    lps = meta.get("output_token_logprobs") or []
    logprobs = [float(x[0]) for x in lps]
    if lps and [int(x[1]) for x in lps] != out:
        raise EngineRequestError(f"engine {engine}: output_token_logprobs token ids disagree with output_ids")
    wv = _version(meta.get("weight_version", 0))
    versions = meta.get("output_token_versions")
    versions = [int(v) for v in versions] if versions is not None else [wv] * len(out)
    fr = meta.get("finish_reason") or {}
    reason = fr.get("type", "abort") if isinstance(fr, dict) else str(fr)
    return GenerateResult(output_ids=out, logprobs=logprobs, versions=versions, finish_reason=reason,
                          weight_version=wv, engine=engine)


class EngineClient:
    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        max_connections: int = 256,
        max_sessions: int = 100_000,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_sessions = max_sessions
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http: httpx.AsyncClient | None = None
        self.inflight = [0] * len(self.urls)
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.tokens_out = 0
        self.retries = 0

    @property
    def in_flight(self) -> int:
        return sum(self.inflight)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return self._http

    # ---- routing ---------------------------------------------------------------------------
    def route(self, session_id: str | None) -> int:
        """Index of the engine for this request (sticky per session, else least loaded)."""
        if session_id is not None and session_id in self.sessions:
            self.sessions.move_to_end(session_id)
            return self.sessions[session_id]
        i = min(range(len(self.urls)), key=lambda k: (self.inflight[k], k))
        if session_id is not None:
            self.sessions[session_id] = i
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return i

    # ---- requests --------------------------------------------------------------------------
    async def _request(self, method: str, url: str, json: Any = None) -> Any:
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = await self._client().request(method, url, json=json)
            except httpx.TransportError as e:
                last = e
                continue
            if r.status_code >= 500:
                last = EngineRequestError(f"{method} {url}: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
                continue
            if r.status_code >= 400:
                raise EngineRequestError(f"{method} {url}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
            return r.json()
        raise EngineRequestError(f"{method} {url} failed after {self.max_retries + 1} attempts: {last!r}",
                                 getattr(last, "status", None))

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        rid = rid or uuid.uuid4().hex
        i = self.route(session_id)
        body = {"input_ids": list(input_ids), "sampling_params": sampling.to_sglang(), "return_logprob": True,
                "rid": rid}
        self.inflight[i] += 1
        try:
            data = await self._request("POST", f"{self.urls[i]}/generate", body)
        finally:
            self.inflight[i] -= 1
        res = parse_generate_reply(data, engine=self.urls[i])
        self.tokens_out += len(res.output_ids)
        return res

    async def _all(self, method: str, path: str, json: Any = None) -> list[Any]:
        return list(await asyncio.gather(*[self._request(method, f"{u}{path}", json) for u in self.urls]))

    async def pause(self, mode: str = "in_place") -> None:
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._all("POST", "/continue_generation", {})

    async def weight_versions(self) -> list[int]:
        return [_version(d.get("weight_version")) for d in await self._all("GET", "/model_info")]

    async def health(self) -> list[bool]:
        async def one(u: str) -> bool:
            try:
                r = await self._client().get(f"{u}/health", timeout=10.0)
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        return list(await asyncio.gather(*[one(u) for u in self.urls]))

    async def abort(self, rid: str | None = None) -> None:
        """Abort request `rid` on every engine, or every request when rid is None."""
        body = {"rid": rid} if rid is not None else {"abort_all": True}
        await self._all("POST", "/abort_request", body)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
