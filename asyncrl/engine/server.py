"""The embedded engine's HTTP server: FastAPI over an `EngineCore`, speaking SGLang's API subset.

Endpoints (as SGLang 0.5.23 answers them; docs/design.md "Engine API"): POST /generate,
/abort_request {rid (prefix match) | abort_all} (200, empty body), /pause_generation {mode: abort|
retract|in_place}, /continue_generation; GET /model_info (string weight_version), /server_info
(tp_size; asyncrl's: the engine's settings as served), /health, /health_generate; asyncrl extension:
GET /stats (queue sizes).
The weight-sync router (asyncrl.weight_sync.routes.make_router(core): the weight-update routes,
sessions and /update_weights_from_disk included) is mounted when installed.
Every bad request gets a 400 with {"error": message}; the server keeps serving.
Bounded per request, whoever calls (asyncrl/util/http_server.py): headers within 10 s, a body of at
most `max_body_bytes(context)` (413, before a byte is parsed) within 60 s (408), input_ids plus
max_new_tokens within the model's context (400, SGLang's rule), and a generation whose client
disconnected is aborted.

Who may call what (asyncrl/util/auth.py, docs/design.md "Threat model"): every route that changes
the engine (abort, pause, continue, every weight-sync POST) needs `Authorization: Bearer <token>`
with the run's token from ASYNCRL_ENGINE_TOKEN; generation and read-only info stay open on loopback.
A non-loopback bind needs a token, and then every route but /health needs it. Disk loads read only
below the model directory and the `weights_dirs` given at launch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from transformers import AutoModelForCausalLM

from asyncrl.config import EngineConfig
from asyncrl.engine.cpu_kernels import use_small_batch_linears
from asyncrl.engine.protocol import BadRequest, parse_request
from asyncrl.engine.scheduler import EngineCore
from asyncrl.models import default_device, engine_dtype, tokenizer_from_dir, torch_dtype
from asyncrl.util.auth import (
    EXPOSED_OPEN,
    LOOPBACK_OPEN,
    TokenGate,
    check_bind,
    token_from_env,
)
from asyncrl.util.http_server import BodyError, read_body, server_config, until_disconnected
from asyncrl.util.net import bind_socket, is_loopback

log = logging.getLogger(__name__)

BODY_BYTES_PER_TOKEN = 16  # a token id in a JSON list: up to 10 digits and ", ", with room to spare
BODY_OVERHEAD_BYTES = 1 << 20  # rid, sampling params, stop ids and the rest beside input_ids


def max_body_bytes(max_context: int) -> int:
    """The largest request body the engine reads: input_ids as long as the model's context, JSON-written,
    plus BODY_OVERHEAD_BYTES. A larger one could only be refused after costing its parse (a 60 MB body
    held the engine's event loop, /health included, for 2.9 s)."""
    return max_context * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


async def _json(request: Request, required: bool = True) -> dict:
    raw = await read_body(request, request.app.state.max_body_bytes,
                          what="the model's context in token ids, JSON-written, plus 1 MiB")
    if not raw.strip():
        if required:
            raise BadRequest("empty request body: a JSON object is required")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def create_app(core: EngineCore, model_path: str = "", on_ready: Any | None = None, *, token: str | None = None,
               loopback: bool = True, weights_dirs: list[str] | None = None) -> FastAPI:
    """The app; `on_ready()` is called once the engine loop runs (the launcher learns the port then).
    `token`: the run's token (None: control routes answer 403); `loopback`: bound to loopback only
    (else every route but /health needs the token); disk loads read only below `model_path` and
    `weights_dirs`."""
    if not loopback and token is None:
        raise ValueError("an engine served beyond loopback needs a token (see check_bind)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        core.start()
        if on_ready is not None:
            on_ready()
        yield
        await core.close()

    app = FastAPI(title="asyncrl embedded engine", lifespan=lifespan)
    app.state.core = core
    app.state.max_body_bytes = max_body_bytes(core.max_context)
    app.add_middleware(TokenGate, token=token, open_routes=LOOPBACK_OPEN if loopback else EXPOSED_OPEN)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(BodyError)
    async def _body(request: Request, exc: BodyError):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.post("/generate")
    async def generate(request: Request):
        req = parse_request(await _json(request), core.vocab_size)
        generation = asyncio.ensure_future(core.generate(req))
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({generation, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not generation.done():  # the client left: nobody reads the rest, so nothing more is generated
            await core.abort(req.rid, exact=True)
        return await generation

    @app.post("/abort_request")
    async def abort_request(request: Request):
        # SGLang: {rid: str = "", abort_all: bool = False}; 200 with an empty body whether or not
        # anything matched; rid matches by prefix; an empty rid without abort_all is ignored.
        body = await _json(request)
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if not isinstance(rid, str):
            raise BadRequest(f"abort_request: rid must be a string, got {rid!r:.80}")
        if not isinstance(abort_all, bool):
            raise BadRequest(f"abort_request: abort_all must be a boolean, got {abort_all!r:.80}")
        await core.abort(rid, abort_all=abort_all)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await _json(request, required=False)
        await core.pause(str(body.get("mode", "abort")))
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await core.resume()
        return {"success": True}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return {"status": "ok"}

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's deprecated alias
    async def model_info():
        # SGLang 0.5 reports the weight version here, as a string (GET /get_weight_version does not exist)
        return {"model_path": model_path, "served_model_name": model_path, "is_generation": True,
                "weight_version": str(core.weight_version)}

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's deprecated alias
    async def server_info():
        s = core.settings  # as served: device and dtype resolved (see `serve`)
        return {"model_path": model_path, "tp_size": 1, "dp_size": 1, "version": "asyncrl-embedded",
                "device": s.device, "dtype": s.dtype, "max_running_seqs": s.max_running_seqs,
                "max_running_tokens": s.max_running_tokens}

    @app.get("/stats")
    async def stats():
        return core.stats()

    try:
        # lazy: optional: the except below reports a missing package
        from asyncrl.weight_sync.routes import make_router
    except ModuleNotFoundError:
        make_router = None
    if make_router is not None:
        roots = [model_path] if model_path else []
        app.include_router(make_router(core, [*roots, *(weights_dirs or [])]))
    return app


ENGINE_PROCESS_NAME = b"asyncrl-engine"  # an engine server's name (`ps -o comm`, psutil's name()), forked or not


def _name_process(name: bytes) -> None:
    """Set this process's name (Linux: PR_SET_NAME; elsewhere nothing): a forked engine keeps its fork
    server's command line (asyncrl/engine/forkserver.py), so the name is what tells an engine apart."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def watch_parent(parent_pid: int, period_s: float = 1.0, scratch_dir: str | None = None) -> threading.Thread:
    """A daemon thread that ends this process (exit code 3) when it is re-parented away from `parent_pid`,
    removing `scratch_dir` first (the launcher's temporary dir of port file and log, which nobody reads once
    the launcher is gone)."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        print(f"asyncrl engine: parent {parent_pid} is gone; exiting", file=sys.stderr, flush=True)
        if scratch_dir:
            shutil.rmtree(scratch_dir, ignore_errors=True)
        os._exit(3)

    t = threading.Thread(target=run, name="watch-parent", daemon=True)
    t.start()
    return t


def serve(
    model_path: str,
    settings: EngineConfig | None = None,
    *,
    port: int = 0,
    weight_version: int = 0,
    port_file: str | None = None,
    threads: int | None = None,
    exit_with_parent: int | None = None,
    weights_dirs: list[str] | None = None,
    scratch_dir: str | None = None,
) -> None:
    """Load the model, bind, announce the port (port_file and a stdout line), serve until killed.

    `settings`: the engine's settings (the run's `engine` config; None: EngineConfig's defaults), taken
    whole: host, then device (None: cuda if available, else cpu) and dtype (auto: `engine_dtype`),
    resolved here, and the scheduler's max_running_seqs and max_running_tokens.

    With `exit_with_parent=PID` the server exits once PID is no longer its parent, so an engine
    whose launcher was SIGKILLed (a crashed Ray actor) does not live on holding memory and a port;
    `scratch_dir` (the launcher's temporary dir) is removed then.
    The token comes from ASYNCRL_ENGINE_TOKEN (never argv); a non-loopback `host` without one is
    refused before anything loads.
    """
    settings = settings if settings is not None else EngineConfig()
    _name_process(ENGINE_PROCESS_NAME)
    host = settings.host
    token = token_from_env()
    check_bind(host, token)
    if token is None:
        print("asyncrl engine: ASYNCRL_ENGINE_TOKEN is not set: generation only, control routes closed (403)",
              file=sys.stderr, flush=True)
    if exit_with_parent is not None:
        watch_parent(exit_with_parent, scratch_dir=scratch_dir)
    if threads:
        torch.set_num_threads(threads)
    device = settings.device or default_device()
    settings = dataclasses.replace(settings, device=device, dtype=engine_dtype(settings.dtype, device))
    print(f"asyncrl engine: serving on {device} in {settings.dtype}", file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(settings.dtype)).to(device)
    use_small_batch_linears(model)  # CPU only: decode-sized GEMMs computed transposed (engine/cpu_kernels.py)
    try:
        tokenizer = tokenizer_from_dir(Path(model_path))
    except (OSError, ValueError):
        tokenizer = None
    core = EngineCore(model, settings, tokenizer=tokenizer, weight_version=weight_version)
    sock = bind_socket(host, port)
    chosen = sock.getsockname()[1]

    def announce() -> None:  # the socket is already listening: connections wait in its backlog
        if port_file:
            tmp = f"{port_file}.tmp"
            Path(tmp).write_text(str(chosen))
            os.replace(tmp, port_file)
        print(f"ASYNCRL_ENGINE_READY http://{host}:{chosen}", flush=True)

    app = create_app(core, model_path, on_ready=announce, token=token, loopback=is_loopback(host),
                     weights_dirs=weights_dirs)
    server = uvicorn.Server(server_config(app))
    server.run(sockets=[sock])
