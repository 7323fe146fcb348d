"""EngineClient: the one async client (httpx) for the embedded engine and SGLang, with a router.

The contract is SGLang 0.5.23's (docs/design.md "Engine API"); what follows is how this client
uses it.

Routing: a request whose `session_id` this client has not seen goes to the engine with the fewest
in-flight requests from this client (ties: the lowest index); later requests of that session go
to the same engine (sticky), so a trajectory's turns share one engine. Sessions are remembered
LRU-bounded (`max_sessions`).

Rids: every POST /generate carries a rid of its own, `<32 hex chars>-<caller's rid>`. SGLang
refuses a rid that is still live (400). Its abort takes an exact rid (the tokenizer drops a rid it
does not hold, and sends an abort once per rid), then its scheduler aborts every request whose rid
STARTS with it; so a rid must be fresh for each attempt and no rid may be a prefix of another: two
different rids of this form differ within their first 32 characters. The client aborts only the
exact rids it sent. An abort of a request still held at SGLang's pause gate is lost (it has not
reached the scheduler); it runs once the engine continues. The caller's rid is kept for the logs only.

Retries: a connection/transport error or a 5xx reply is retried up to `max_retries` times with
exponential backoff and a fresh rid; after a read timeout the old rid is aborted first (best
effort), so the engine does not go on generating for nobody. 4xx replies raise
`EngineRequestError` at once. A cancelled `generate` aborts its request on the engine. The defaults
(the config's engine.request_timeout_s=180, max_retries=2, read from EngineConfig) give up on an
engine that accepts connections but never answers after 3 x 180 s + backoff, about 9 minutes; a
refused connection fails in under 2 s.

Versions: SGLang answers `meta_info.weight_versions`, spans [{"version": str, "start", "end"}]
(end exclusive) covering the output; the client expands them to one int per output token and
refuses a reply whose spans are missing, malformed or do not tile the output, or whose versions
are not integers, naming the value.

Partial rollout: a generation that ends with finish_reason abort and no `status_code` (what a
weight sync with `mode=abort` leaves: SGLang's pause_generation(abort) aborts everything with a
bare FINISH_ABORT) is continued from prompt + partial output with the remaining budget and a fresh
rid, up to `max_abort_rounds` times; SGLang and the embedded engine hold a request posted while
they are paused until they continue, so the continuation runs on the new weights. The pieces are
concatenated: the result keeps each token's logprob and version. An abort that carries a
status_code (an engine-side error or timeout) ends the generation as abort. SGLang's abort reply
says nothing more, so an operator's abort_all is continued like a sync's (bounded by the rounds).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Sequence
from typing import Any, Self

import httpx

from asyncrl.config import EngineConfig
from asyncrl.engine.base import GenerateResult, SamplingParams
from asyncrl.util.auth import auth_headers

log = logging.getLogger(__name__)

MAX_SPANS = 1 << 16  # a reply with more spans than this is refused, not expanded


class EngineRequestError(RuntimeError):
    """An engine answered with an error, or stayed unreachable after the retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def parse_version(v: Any, where: str) -> int:
    """A weight version from the wire (SGLang sends strings) -> int; anything else is refused by name."""
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise EngineRequestError(f"{where}: weight version {v!r:.80} is not an integer string")
    try:
        return int(v)
    except ValueError:
        raise EngineRequestError(f"{where}: weight version {v!r:.80} is not an integer; asyncrl launches "
                                 "engines with --weight-version N (SGLang's default is 'default')") from None


def expand_spans(spans: Any, n: int, where: str) -> list[int]:
    """SGLang's `weight_versions` spans -> one version per output token. The spans must tile
    [0, n) in order (an empty output: one span with end 0)."""
    if not isinstance(spans, list) or not spans:
        raise EngineRequestError(f"{where}: meta_info.weight_versions must be a non-empty list, got {spans!r:.120}")
    if len(spans) > MAX_SPANS or len(spans) > n + 1:
        raise EngineRequestError(f"{where}: {len(spans)} weight_versions spans for {n} output tokens")
    out: list[int] = []
    for k, s in enumerate(spans):
        if not isinstance(s, dict) or not {"version", "start", "end"} <= set(s):
            raise EngineRequestError(f"{where}: weight_versions[{k}]={s!r:.120} is not {{version, start, end}}")
        start, end = s["start"], s["end"]
        if any(isinstance(x, bool) or not isinstance(x, int) for x in (start, end)):
            raise EngineRequestError(f"{where}: weight_versions[{k}] has non-integer bounds {start!r:.40}, {end!r:.40}")
        if start != len(out) or not start <= end <= n:
            raise EngineRequestError(f"{where}: weight_versions[{k}] = [{start}, {end}) does not continue "
                                     f"the spans at {len(out)} within {n} output tokens")
        out.extend([parse_version(s["version"], f"{where}: weight_versions[{k}]")] * (end - start))
    if len(out) != n:
        raise EngineRequestError(f"{where}: weight_versions cover {len(out)} of {n} output tokens")
    return out


def parse_generate_reply(data: Any, engine: str = "") -> GenerateResult:
    """An SGLang /generate reply -> GenerateResult (one logprob and one version per output token)."""
    where = f"engine {engine}" if engine else "engine"
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise EngineRequestError(f"{where}: /generate reply has no meta_info: {data!r:.200}")
    meta = data["meta_info"]
    out = data.get("output_ids")
    if not isinstance(out, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in out):
        raise EngineRequestError(f"{where}: output_ids must be a list of token ids, got {out!r:.120}")
    lps = meta.get("output_token_logprobs") or []
    if len(lps) != len(out) or any(not isinstance(x, list) or len(x) < 2 for x in lps):
        raise EngineRequestError(f"{where}: {len(lps)} output_token_logprobs for {len(out)} output_ids")
    if [x[1] for x in lps] != out:
        raise EngineRequestError(f"{where}: output_token_logprobs token ids disagree with output_ids")
    versions = expand_spans(meta.get("weight_versions"), len(out), where)
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") not in ("stop", "length", "abort"):
        raise EngineRequestError(f"{where}: finish_reason {fr!r:.120} is not {{type: stop|length|abort}}")
    return GenerateResult(output_ids=list(out), logprobs=[float(x[0]) for x in lps], versions=versions,
                          finish_reason=fr["type"], weight_version=parse_version(meta.get("weight_version"), where),
                          engine=engine)


def is_sync_abort(data: dict) -> bool:
    """An abort without a status_code: what SGLang's pause_generation(mode=abort) leaves (a bare
    FINISH_ABORT), as opposed to an engine-side error or timeout abort, which carries one."""
    fr = data["meta_info"]["finish_reason"]
    return fr["type"] == "abort" and fr.get("status_code") is None


def wire_rid(rid: str | None) -> str:
    """A fresh rid for one POST: 32 random hex characters first, so no two are prefixes of each other."""
    return f"{uuid.uuid4().hex}-{rid}" if rid else uuid.uuid4().hex


class EngineClient:
    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout_s: float = EngineConfig.request_timeout_s,
        connect_timeout_s: float = 10.0,
        max_retries: int = EngineConfig.max_retries,
        backoff_s: float = 0.2,
        max_connections: int = 256,
        max_sessions: int = 100_000,
        max_abort_rounds: int = 8,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        if max_abort_rounds < 0:
            raise ValueError(f"max_abort_rounds must be >= 0, got {max_abort_rounds}")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_sessions = max_sessions
        self.max_abort_rounds = max_abort_rounds
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http: httpx.AsyncClient | None = None
        self._background: set[asyncio.Task] = set()
        self.inflight = [0] * len(self.urls)
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.tokens_out = 0
        self.retries = 0
        self.continued = 0  # generations continued after a sync abort (partial rollout)

    @property
    def in_flight(self) -> int:
        return sum(self.inflight)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # the run's token (ASYNCRL_ENGINE_TOKEN): /abort_request needs it; /generate, beyond loopback
            self._http = httpx.AsyncClient(timeout=self._timeout, limits=self._limits, headers=auth_headers())
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
    def _abort_later(self, url: str, rid: str) -> None:
        """POST /abort_request for `rid` without waiting (the request's owner has given up on it)."""

        async def run() -> None:
            try:
                r = await self._client().post(f"{url}/abort_request", json={"rid": rid}, timeout=10.0)
            except httpx.HTTPError:
                return
            if r.status_code in (401, 403):  # the request runs on: say why, once per refusal
                log.warning("engine %s refused /abort_request with HTTP %d: this process lacks the engine's token "
                            "(ASYNCRL_ENGINE_TOKEN)", url, r.status_code)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def set_urls(self, urls: Sequence[str]) -> None:
        """Engine i is now reached at urls[i] (a relaunch on another node); requests and retries that start
        from now on go there, sticky sessions keep their index."""
        urls = [u.rstrip("/") for u in urls]
        if len(urls) != len(self.urls):
            raise ValueError(f"set_urls: {len(urls)} URLs for {len(self.urls)} engines")
        self.urls = urls

    async def _post_generate(self, i: int, body: dict, rid: str | None) -> tuple[Any, str]:
        """One /generate to engine i with retries (each to its URL at that moment); every attempt has a fresh
        rid. Returns the reply and the URL that gave it."""
        last: BaseException | None = None
        url = self.urls[i]
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            url = self.urls[i]
            body["rid"] = wire_rid(rid)
            try:
                r = await self._client().post(f"{url}/generate", json=body)
            except httpx.TimeoutException as e:
                self._abort_later(url, body["rid"])
                last = e
                continue
            except httpx.TransportError as e:
                last = e
                continue
            except asyncio.CancelledError:
                self._abort_later(url, body["rid"])
                raise
            if r.status_code >= 500:
                last = EngineRequestError(f"POST {url}/generate: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
                continue
            if r.status_code >= 400:
                raise EngineRequestError(f"POST {url}/generate: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
            try:
                return r.json(), url
            except ValueError:
                raise EngineRequestError(f"POST {url}/generate: reply is not JSON: {r.text[:200]!r}") from None
        raise EngineRequestError(f"POST {url}/generate failed after {self.max_retries + 1} attempts: {last!r}",
                                 getattr(last, "status", None))

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        i = self.route(session_id)
        url = self.urls[i]
        budget = sampling.max_new_tokens
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        self.inflight[i] += 1
        try:
            for round_ in range(self.max_abort_rounds + 1):
                sp = sampling.to_sglang()
                sp["max_new_tokens"] = budget - len(out)
                sp["min_new_tokens"] = max(0, sampling.min_new_tokens - len(out))
                body = {"input_ids": list(input_ids) + out, "sampling_params": sp, "return_logprob": True}
                data, url = await self._post_generate(i, body, rid)
                piece = parse_generate_reply(data, engine=url)
                out += piece.output_ids
                logprobs += piece.logprobs
                versions += piece.versions
                if not is_sync_abort(data) or len(out) >= budget or round_ == self.max_abort_rounds:
                    break
                self.continued += 1
        finally:
            self.inflight[i] -= 1
        self.tokens_out += len(out)
        reason = piece.finish_reason
        if reason == "abort" and len(out) >= budget:  # the budget ran out in the aborted piece
            reason = "length"
        return GenerateResult(output_ids=out, logprobs=logprobs, versions=versions, finish_reason=reason,
                              weight_version=piece.weight_version, engine=url)

    async def weight_versions(self) -> list[int]:
        """Each engine's current weight version (GET /model_info, which answers while paused)."""

        async def one(u: str) -> int:
            try:
                r = await self._client().get(f"{u}/model_info")
            except httpx.HTTPError as e:
                raise EngineRequestError(f"GET {u}/model_info: {e!r}") from None
            if r.status_code != 200:
                raise EngineRequestError(f"GET {u}/model_info: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
            return parse_version(r.json().get("weight_version"), f"engine {u} /model_info")

        return list(await asyncio.gather(*[one(u) for u in self.urls]))

    async def close(self) -> None:
        for t in list(self._background):
            await asyncio.wait([t], timeout=10.0)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
