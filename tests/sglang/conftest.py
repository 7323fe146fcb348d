"""SGLang 0.5.23's real HTTP app (routes, request validation, the /generate contract gate, error
handling) on a real socket, with only its backend, the TokenizerManager, replaced by a recorder
that answers as SGLang's TokenizerManager + scheduler do (paths under sglang/srt/):
- per-token weight-version events and spans built by SGLang's own functions (utils/weight_versions.py);
- abort: the tokenizer looks the rid up exactly (tokenizer_manager.py abort_request: an unknown rid is
  dropped, a repeated one sent once); the scheduler then aborts every request it holds whose rid
  starts with it (scheduler.py abort_request); a request still held at the pause gate has not
  reached the scheduler, so an abort of it is lost;
- pause: every /generate waits at the gate while paused (tokenizer_manager.py:938); mode abort
  aborts everything started and returns only once no started request is left, re-aborting every
  second (tokenizer_manager.py pause_generation); continue opens the gate;
- a running batch of at most `max_running` requests (None: unbounded): a request beyond it waits in
  the scheduler's queue; a health check (rid HEALTH_CHECK_*) takes no slot: a busy scheduler answers
  it after its next step (scheduler.py return_health_check_ipcs), an idle one runs it;
- `stuck`: a hung scheduler: no step, no health answer, no control answer (/server_info);
- a duplicate live rid refused, errors with a status_code.

Runs only where `sglang` imports (scripts/setup_sglang_env.sh makes .venv-sglang); skipped
elsewhere with the import error as the reason.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import types
import uuid
from typing import Any

import pytest

os.environ.setdefault("SGLANG_HEALTH_CHECK_TIMEOUT", "2")  # read when http_server is imported

try:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import AbortReq  # noqa: F401  (the route's body type)
    from sglang.srt.utils.weight_versions import (
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
        record_weight_version_events,
    )
except Exception as e:  # ImportError, or an import-time error of SGLang's chain on this machine
    http_server = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    _IMPORT_ERROR = ""
    # SGLang's own auth middleware, as `launch_sglang` configures it (keys.yaml: admin-api-key = the run's
    # token; loopback, so no api-key): the contract tests then prove asyncrl's sender and client carry
    # the header SGLang accepts, and test_control_routes_need_the_token sees SGLang's refusals.
    from sglang.srt.utils.auth import add_api_key_middleware

    from asyncrl.util.auth import ensure_token

    add_api_key_middleware(http_server.app, api_key=None, admin_api_key=ensure_token())

skip_without_sglang = pytest.mark.skipif(
    http_server is None,
    reason=f"sglang 0.5.23 is not importable here ({_IMPORT_ERROR[:300]}); make .venv-sglang with "
           "scripts/setup_sglang_env.sh and run .venv-sglang/bin/python -m pytest -m sglang tests/sglang")


class InjectedError(ValueError):
    """A backend failure with an HTTP status, as SGLang raises them (serve_generate_request turns a
    ValueError into a reply with its status_code)."""

    def __init__(self, msg: str, status_code: int):
        super().__init__(msg)
        self.status_code = status_code


class _Req:
    def __init__(self, rid: str, input_ids: list[int], sp: dict):
        self.rid, self.input_ids, self.sp = rid, input_ids, sp
        self.dispatched = False  # past the pause gate: the scheduler holds it
        self.abort_sent = False
        self.admitted = False  # in the running batch
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weight_version_events: list = []
        self.finish: dict | None = None


class RecordingTokenizerManager:
    """What http_server's native routes call on `_global_state.tokenizer_manager`."""

    def __init__(self, weight_version: str = "0", step_s: float = 0.002, max_running: int | None = None,
                 server_args: Any = None):
        self.weight_version = weight_version
        self.step_s = step_s
        self.max_running = max_running
        self.stuck = False
        self.readers = 0  # requests past the pause gate (model_update_lock's reader lock)
        self.server_args, self.startup_time = server_args, time.time()  # read by /server_info
        self.live: dict[str, _Req] = {}
        self.rids: list[str] = []  # every rid a /generate carried, in order
        self.aborts: list[tuple[str, bool]] = []
        self.fail_next: list[int] = []  # statuses to fail the next /generate calls with
        self.is_pause = False
        self._cond: asyncio.Condition | None = None
        self.tokens_out = 0
        # read by /health and /model_info
        self.gracefully_exit = False
        self.server_status = None
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict = {}
        self.model_path = self.served_model_name = "recorder"
        self.model_config = types.SimpleNamespace(is_image_understandable_model=False,
                                                  is_audio_understandable_model=False,
                                                  hf_config=types.SimpleNamespace(model_type="llama",
                                                                                  architectures=["X"]))

    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def config_value(self, name: str) -> Any:
        return {"weight_version": self.weight_version}.get(name)

    # ---- /generate ---------------------------------------------------------------------
    async def generate_request(self, obj: Any, request: Any = None):
        rid = obj.rid or uuid.uuid4().hex
        if rid.startswith("HEALTH_CHECK"):
            async with self.cond():  # held at the gate while paused, like any generation
                await self.cond().wait_for(lambda: not self.is_pause)
            while self.stuck:
                await asyncio.sleep(self.step_s)
            await asyncio.sleep(self.step_s)  # answered after the next step, or run
            self.last_receive_tstamp = time.time()
            yield {}
            return
        self.rids.append(rid)
        if rid in self.live:  # TokenizerManager._init_req_state
            raise ValueError(f"Duplicate request ID detected: {rid}")
        if self.fail_next:
            raise InjectedError("injected backend failure", self.fail_next.pop(0))
        sp = obj.sampling_params or {}
        req = _Req(rid, list(obj.input_ids), sp)
        self.live[rid] = req
        try:
            async with self.cond():  # a request posted while paused waits (tokenizer_manager.py:938)
                await self.cond().wait_for(lambda: not self.is_pause)
            req.dispatched, self.readers = True, self.readers + 1
            try:
                await self._run(req, int(sp.get("max_new_tokens", 128)))
            finally:
                self.readers -= 1
        finally:
            self.live.pop(rid, None)
        n_out = len(req.output_ids)
        meta = {"id": rid, "finish_reason": req.finish, "prompt_tokens": len(req.input_ids),
                "weight_version": self.weight_version, "completion_tokens": n_out, "cached_tokens": 0}
        if obj.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
        spans = compute_weight_version_spans(req.weight_version_events, current_version=self.weight_version,
                                             num_output_tokens=n_out)
        add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n_out)
        yield {"text": "", "output_ids": list(req.output_ids), "meta_info": meta}

    def running(self) -> int:
        return sum(1 for r in self.live.values() if r.admitted and r.finish is None)

    async def _run(self, req: _Req, n: int) -> None:
        """The scheduler: wait for a slot in the running batch, then one token per step until done."""
        while req.finish is None and self.max_running is not None and self.running() >= self.max_running:
            await asyncio.sleep(self.step_s)
        req.admitted = True
        while req.finish is None:
            if len(req.output_ids) >= n:
                req.finish = {"type": "length", "length": n}
                break
            if not self.is_pause and not self.stuck:
                t = (sum(req.input_ids) + len(req.output_ids)) % 1000
                req.output_ids.append(t)
                req.logprobs.append(-0.01 * (1 + t % 7))
                self.tokens_out += 1
            await asyncio.sleep(self.step_s)

    async def get_internal_state(self) -> list[dict]:  # /server_info: the scheduler answers, unless hung
        while self.stuck:
            await asyncio.sleep(self.step_s)
        return [{}]

    # ---- control -----------------------------------------------------------------------
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborts.append((rid, abort_all))
        if not abort_all:
            state = self.live.get(rid)  # the tokenizer's exact lookup: an unknown rid is dropped
            if not rid or state is None or state.abort_sent:
                return
            state.abort_sent = True
        for r in list(self.live.values()):  # the scheduler matches what it holds by prefix
            if r.dispatched and r.finish is None and (abort_all or r.rid.startswith(rid)):
                r.finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    async def pause_generation(self, obj: Any) -> None:
        async with self.cond():
            self.is_pause = True
            if obj.mode == "abort":  # returns once no started request is left
                while True:
                    self.abort_request(abort_all=True)
                    if not self.readers:
                        break
                    await asyncio.sleep(1.0)

    async def continue_generation(self, obj: Any) -> None:
        async with self.cond():
            self.is_pause = False
            self.cond().notify_all()

    async def update_weight_version(self, obj: Any) -> None:
        self.set_weight_version(obj.new_version)

    def set_weight_version(self, new_version: str) -> None:
        """Scheduler.record_weight_version_change: live requests record the old version's extent."""
        if new_version != self.weight_version:
            record_weight_version_events(list(self.live.values()), old_version=self.weight_version)
            self.weight_version = new_version


class SGLangApp:
    """http_server.app on a uvicorn thread (lifespan off: no OpenAI servers, no warmup)."""

    def __init__(self, tm: RecordingTokenizerManager):
        import uvicorn

        from asyncrl.util.net import free_port

        self.tm = tm
        http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tm, template_manager=None,
                                                              scheduler_info={}))
        port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(http_server.app, host="127.0.0.1", port=port, lifespan="off",
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> SGLangApp:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("SGLang's app did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def sglang_config(tmp_path_factory):
    """Publish SGLang's process config (what /health and /model_info read through get_disagg() and
    get_serving()) for a config-only checkpoint directory: no weights, CPU. Returns the ServerArgs
    (/server_info reads them from the TokenizerManager)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("sglang_cfg")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(d)
    # dtype float32: what the recorder holds (its params); under "auto" SGLang would serve this fp32
    # config in float16, and the sender would cast to it (asyncrl.models.sglang_served_dtype)
    args = ServerArgs(model_path=str(d), weight_version="0", skip_tokenizer_init=True, device="cpu", dtype="float32")
    runtime_context.publish(args, role=next(iter(runtime_context.ROLE_NAMESPACE_SETS)))
    return args


@pytest.fixture
def sglang_app(sglang_config):
    tm = RecordingTokenizerManager()
    with SGLangApp(tm) as app:
        yield app
