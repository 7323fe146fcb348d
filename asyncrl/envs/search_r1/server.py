"""The retrieval HTTP server (FastAPI + uvicorn); `launcher.py` runs it as a child process.

API (the shape verl's and Search-R1's search tools call):
  POST /retrieve {"queries": [str, ...], "topk": int = 3, "return_scores": bool = true}
    -> 200 {"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}
       (with return_scores=false each hit is the bare document)
    -> 400 {"error": "..."} for a body that is not JSON or not of that shape; the server keeps serving.
    -> 413 for a body over MAX_BODY_BYTES (before a byte is parsed), 408 for one not sent within 60 s;
       headers are due within 10 s (asyncrl/util/http_server.py).
  GET /health -> {"status": "ok", "documents": N, "method": "bm25"}

`serve` binds the port itself (0: a free one) and announces the URL on its stdout (`READY_PREFIX` +
url), so the launcher never races between picking and binding a port.

(No `from __future__ import annotations` in this module: FastAPI must see the real `Request` type.)
"""

import json
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from asyncrl.util.http_server import BodyError, read_body, server_config

from .corpus import load_corpus
from .launcher import READY_PREFIX
from .retrieval import build_index

MAX_QUERIES = 4096
MAX_BODY_BYTES = 16 << 20  # MAX_QUERIES queries of about 4 KB each (a query is one turn of model output)


def create_app(index: Any):
    """A FastAPI app serving `index` (anything with .search(queries, topk), .busy, len() and .method)."""
    app = FastAPI(title="asyncrl retriever")

    def bad(msg: str) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=400)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "documents": len(index), "method": index.method}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            raw = await read_body(request, MAX_BODY_BYTES, what=f"{MAX_QUERIES} queries of about 4 KB")
        except BodyError as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return bad(f"body is not JSON: {e}")
        if not isinstance(body, dict):
            return bad(f"body must be a JSON object with 'queries', got {type(body).__name__}")
        queries = body.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return bad("'queries' must be a list of strings")
        if len(queries) > MAX_QUERIES:
            return bad(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
        topk = body.get("topk", 3)
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            return bad(f"'topk' must be an integer >= 1, got {topk!r}")
        return_scores = body.get("return_scores", True)
        # BM25 costs ~1 ms a query: a few are cheaper inline than a thread hand-off; dense never is
        if len(queries) <= getattr(index, "inline_queries", 0) and not index.busy:
            result = index.search(queries, topk) if queries else []
        else:  # big batches go to a worker thread so /health and small requests stay responsive
            result = await run_in_threadpool(index.search, queries, topk)
        if not return_scores:
            result = [[hit["document"] for hit in hits] for hits in result]
        return {"result": result}

    return app


def serve(corpus: str, *, host: str = "127.0.0.1", port: int = 0, method: str = "bm25",
          log_level: str = "warning") -> None:
    """Load and index `corpus`, bind host:port (0: a free port), announce the URL on stdout, serve."""
    index = build_index(load_corpus(corpus), method)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # (TCP_NODELAY is set on each accepted connection by server_config's protocol: asyncrl/util/http_server.py)
    sock.bind((host, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    url_host = f"[{host}]" if family == socket.AF_INET6 else host
    config = server_config(create_app(index), log_level=log_level)
    server = uvicorn.Server(config)
    print(f"{READY_PREFIX}http://{url_host}:{bound} ({len(index)} documents, {method})", flush=True)
    server.run(sockets=[sock])
