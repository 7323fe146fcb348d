"""`ProxyServer`: the OpenAI-compatible HTTP endpoint, on loopback, in the rollout worker's event loop.

Routes (all need `Authorization: Bearer <episode key>`; a missing, unknown or ended key is 401 in
OpenAI's shape): `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, and
`POST /rl/set_reward` {reward, completion_id?}. Each episode opens a `Session` (its own key) and
closes it when it ends. Generation goes token in, token out through the rollout side's `Generator`
(the engine client and its router, sticky per episode: `session_id` is the episode's uid).

Per request: the body's size (at most `max_body_bytes`, from the context budget: larger is 413 before a
byte of it is parsed or tokenized, counted as it streams in, whatever Content-Length says) -> validate
(requests.py) -> prompt ids (Session.chat_prompt / text_prompt) -> budget
(prompt + max_tokens within agent.max_prompt_tokens + agent.max_response_tokens, else 400
context_length_exceeded; max_tokens defaults to agent.max_turn_tokens) -> generate with the
request's temperature / top_p / seed (else agent.sampling's), agent.sampling's top_k and
min_new_tokens, the template's
stop tokens -> cut at the first `stop` string (a prefix of the engine's ids, so logprobs and versions
stay exact) -> tool calls parsed by agent.tool_parser into `tool_calls` when the request has tools
and tool_choice is not "none" -> record -> reply (replies.py). An engine failure is answered 503
and kept on the session, which fails the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import resolve_parser
from asyncrl.config import AgentConfig, RewardConfig
from asyncrl.engine.base import Generator, SamplingParams
from asyncrl.util import http_server
from asyncrl.util.net import bind_socket, is_loopback

from . import replies
from .errors import OpenAIError, bad
from .requests import Sampling, _number, parse_body, parse_chat, parse_completion
from .session import CallRecord, Session

MAX_FORMATS = 64  # chat formats cached by tool list


class _InLoopServer(uvicorn.Server):
    """uvicorn inside an event loop it does not own: no signal handlers (they belong to the host process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def trim_at_stop(ids: list[int], text: str, stops: list[str], decode: Any) -> Optional[int]:
    """The number of ids to keep when `text` holds a stop string: the largest k whose decoded text ends
    at or before the first stop string; None when none occurs."""
    pos = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
    if pos < 0:
        return None
    k = 0
    for i in range(1, len(ids) + 1):
        if len(decode(ids[:i])) > pos:
            break
        k = i
    return k


BODY_OVERHEAD_BYTES = 1 << 20  # JSON structure, roles, tool schemas and other fields beside the text
JSON_BYTES_PER_CHAR = 6  # the most JSON spends on one character (a \uXXXX escape)


def max_body_bytes(cfg: AgentConfig, tokenizer: Any) -> int:
    """The largest request body that can still fit the context (agent.max_prompt_tokens +
    agent.max_response_tokens tokens): every token as long as the vocabulary's longest, every character
    JSON-escaped, plus BODY_OVERHEAD_BYTES. A larger body would be refused as too long anyway, after
    costing its parse and tokenization (a 200 MB one blocked the rollout worker's event loop for minutes)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return (cfg.max_prompt_tokens + cfg.max_response_tokens) * longest * JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body within this proxy's bounds (asyncrl/util/http_server.py: 413 past `limit` bytes,
    408 when it trickles), as an OpenAI-shaped error."""
    try:
        return await http_server.read_body(request, limit,
                                           what="the context budget: agent.max_prompt_tokens + agent.max_response_tokens")
    except http_server.BodyError as e:
        code = "request_too_large" if e.status == 413 else "request_timeout"
        raise OpenAIError(e.status, str(e), param="body", code=code) from None


class ProxyServer:
    def __init__(self, engine: Generator, tokenizer: Any, cfg: AgentConfig, *, model_name: str = "asyncrl-policy",
                 host: str = "127.0.0.1", reward_max_abs: float = RewardConfig().max_abs):
        if not is_loopback(host):
            raise ValueError(f"the OpenAI proxy serves loopback only, got host {host!r}")
        self.engine, self.tok, self.cfg, self.model_name, self.host = engine, tokenizer, cfg, model_name, host
        self.parser = resolve_parser(cfg.tool_parser, tokenizer)
        self.stop_ids = ChatFormat(tokenizer).stop_token_ids()
        self.vocab_size = len(tokenizer)
        self.max_body_bytes = max_body_bytes(cfg, tokenizer)
        self.reward_max_abs = reward_max_abs  # env.reward.max_abs: /rl/set_reward refuses a reward beyond it
        self.sessions: dict[str, Session] = {}
        self._formats: OrderedDict[str, ChatFormat] = OrderedDict()
        self._server: Optional[_InLoopServer] = None
        self._task: Optional[asyncio.Task] = None
        self.port = 0
        self.app = self._app()

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> ProxyServer:
        sock = bind_socket(self.host, 0)
        self.port = sock.getsockname()[1]
        self._server = _InLoopServer(http_server.server_config(self.app, lifespan="off"))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the OpenAI proxy server stopped while starting")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    async def __aenter__(self) -> ProxyServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def open_session(self, uid: str) -> Session:
        s = Session(uid, max_calls=self.cfg.max_assistant_turns)
        self.sessions[s.key] = s
        return s

    def close_session(self, s: Session) -> None:
        s.closed = True
        self.sessions.pop(s.key, None)

    # ---- helpers ---------------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat_format(self, tools: list[dict[str, Any]]) -> ChatFormat:
        key = json.dumps(tools, sort_keys=True)
        f = self._formats.get(key)
        if f is None:
            f = self._formats[key] = ChatFormat(self.tok, tools=tools)
            while len(self._formats) > MAX_FORMATS:
                self._formats.popitem(last=False)
        self._formats.move_to_end(key)
        return f

    def session_of(self, request: Request) -> Session:
        auth = request.headers.get("authorization", "")
        if not auth:
            raise OpenAIError(401, "You didn't provide an API key. Send the episode's key as "
                              "'Authorization: Bearer <key>' (OPENAI_API_KEY).", code="invalid_api_key")
        scheme, _, key = auth.partition(" ")
        s = self.sessions.get(key.strip()) if scheme.lower() == "bearer" else None
        if s is None:
            raise OpenAIError(401, "Incorrect API key provided: not a live episode's key.", code="invalid_api_key")
        return s

    def fingerprint(self, rec: CallRecord) -> str:
        return f"asyncrl-v{max(rec.versions, default=0)}"

    async def generate(self, s: Session, kind: str, prompt_ids: list[int], sp: Sampling, param: str) -> CallRecord:
        """Budget, sample, cut at stop strings, record nothing yet (the caller adds the reply's parts)."""
        limit = self.cfg.max_prompt_tokens + self.cfg.max_response_tokens
        if len(prompt_ids) >= limit:
            raise OpenAIError(400, f"{param}: this model's maximum context length is {limit} tokens (agent.max_prompt_"
                              f"tokens + agent.max_response_tokens); the prompt has {len(prompt_ids)}",
                              param=param, code="context_length_exceeded")
        room = limit - len(prompt_ids)
        if sp.max_tokens is not None and sp.max_tokens > room:
            raise OpenAIError(400, f"max_tokens: {sp.max_tokens} requested, but the context of {limit} tokens leaves "
                              f"{room} after the prompt's {len(prompt_ids)}", param="max_tokens",
                              code="context_length_exceeded")
        if s.started >= s.max_calls:
            raise OpenAIError(400, f"this episode has made its {s.max_calls} calls (agent.max_assistant_turns)",
                              code="call_limit_reached")
        s.started += 1
        base = self.cfg.sampling
        temperature = base.temperature if sp.temperature is None else sp.temperature
        s.sampling_overridden += int(temperature != base.temperature)
        max_new = sp.max_tokens if sp.max_tokens is not None else min(self.cfg.max_turn_tokens, room)
        params = SamplingParams(temperature=temperature, top_p=base.top_p if sp.top_p is None else sp.top_p,
                                top_k=base.top_k, max_new_tokens=max_new, min_new_tokens=min(base.min_new_tokens, max_new),
                                stop_token_ids=list(self.stop_ids),
                                sampling_seed=sp.seed)
        try:
            out = await self.engine.generate(prompt_ids, params, rid=f"{s.uid}-call{s.started}", session_id=s.uid)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine failed: the agent gets a 503, the episode fails with this error
            s.engine_error = s.engine_error or e
            raise OpenAIError(503, f"the engine failed: {e}", type="server_error", code="engine_error") from None
        ids, lps, vers, finish = list(out.output_ids), list(out.logprobs), list(out.versions), out.finish_reason
        text = self.decode(ids)
        k = trim_at_stop(ids, text, sp.stop, self.decode) if sp.stop else None
        if k is not None:
            ids, lps, vers, finish = ids[:k], lps[:k], vers[:k], "stop"
            text = self.decode(ids)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return CallRecord(id=prefix + uuid.uuid4().hex, kind=kind, prompt_ids=list(prompt_ids), output_ids=ids,
                          logprobs=lps, versions=vers, finish_reason=finish, text=text)

    # ---- routes ----------------------------------------------------------------------------
    async def chat(self, s: Session, body: dict[str, Any]) -> Any:
        req = parse_chat(body)
        chat = self.chat_format(req.tools)
        prompt_ids, mapped = s.chat_prompt(chat, req.messages, self.parser)
        s.messages_mapped += mapped
        rec = await self.generate(s, "chat", prompt_ids, req.sampling, "messages")
        rec.content = rec.text
        if req.tools and req.tool_choice != "none":
            parsed = self.parser.parse(rec.text)
            if parsed.calls and all(c.error is None for c in parsed.calls):
                rec.tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                   "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                                  for c in parsed.calls]
                rec.content = parsed.content or None
        rec.messages = [{"role": m.role, "content": m.content} for m in req.messages]
        s.records.append(rec)
        model = req.model or self.model_name
        if req.stream:
            return StreamingResponse(replies.chat_chunks(rec, model, req.logprobs, req.include_usage, self.decode,
                                                         self.fingerprint(rec)), media_type="text/event-stream")
        return replies.chat_reply(rec, model, req.logprobs, self.decode, self.fingerprint(rec))

    async def completion(self, s: Session, body: dict[str, Any]) -> Any:
        req = parse_completion(body, self.vocab_size)
        prompt_ids = s.text_prompt(lambda t: list(self.tok.encode(t, add_special_tokens=False)), req.prompt)
        rec = await self.generate(s, "text", prompt_ids, req.sampling, "prompt")
        rec.prompt_text = req.prompt if isinstance(req.prompt, str) else self.decode(req.prompt)
        rec.messages = [{"role": "user", "content": rec.prompt_text}]
        s.records.append(rec)
        model = req.model or self.model_name
        if req.stream:
            return StreamingResponse(replies.completion_chunks(rec, model, req.logprobs, req.include_usage, self.decode),
                                     media_type="text/event-stream")
        return replies.completion_reply(rec, model, req.logprobs, self.decode)

    def set_reward(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - {"reward", "completion_id"})
        if unknown:
            raise bad(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter")
        if body.get("reward") is None:
            raise bad("reward", "a finite number is required", "invalid_type")
        reward = _number(body, "reward", -self.reward_max_abs, self.reward_max_abs)
        cid = body.get("completion_id")
        if cid is None:
            s.reward = reward
        elif not isinstance(cid, str) or cid not in s.completion_ids():
            raise bad("completion_id", f"{cid!r:.80} is not a completion of this episode")
        else:
            s.completion_rewards[cid] = reward
        return {"ok": True}

    def _app(self) -> FastAPI:
        app = FastAPI(title="asyncrl OpenAI-compatible proxy", openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(OpenAIError)
        async def _err(request: Request, exc: OpenAIError):
            s = self.sessions.get(request.headers.get("authorization", "").partition(" ")[2].strip())
            if s is not None and exc.status == 400:
                s.bad_requests += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            s = self.session_of(request)
            return await self.chat(s, parse_body(await read_body(request, self.max_body_bytes)))

        @app.post("/v1/completions")
        async def completions(request: Request):
            s = self.session_of(request)
            return await self.completion(s, parse_body(await read_body(request, self.max_body_bytes)))

        @app.get("/v1/models")
        async def models(request: Request):
            self.session_of(request)
            return replies.model_list(self.model_name)

        @app.post("/rl/set_reward")
        async def set_reward(request: Request):
            s = self.session_of(request)
            return self.set_reward(s, parse_body(await read_body(request, self.max_body_bytes)))

        return app
