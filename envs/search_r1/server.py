"""The retrieval HTTP server (FastAPI + uvicorn) and a handle to run it as a child process.

API (the shape verl's and Search-R1's search tools call):
  POST /retrieve {"queries": [str, ...], "topk": int = 3, "return_scores": bool = true}
    -> 200 {"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}
       (with return_scores=false each hit is the bare document)
    -> 400 {"error": "..."} for a body that is not JSON or not of that shape; the server keeps serving.
  GET /health -> {"status": "ok", "documents": N, "method": "bm25"}

`start_retriever(corpus_path, host=, port=0, method=)` starts `asyncrl retriever serve` as a real
child process; with port 0 the child binds a free port itself and announces it on its stdout
(`READY_PREFIX` + url), so there is no race between picking and binding a port.
"""


import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

READY_PREFIX = "asyncrl-retriever listening on "
MAX_QUERIES = 4096


def create_app(index: Any):
    """A FastAPI app serving `index` (anything with .search(queries, topk), .busy, len() and .method).

    (No `from __future__ import annotations` in this module: FastAPI must see the real `Request` type.)"""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="asyncrl retriever")

    def bad(msg: str) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=400)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "documents": len(index), "method": index.method}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        raw = await request.body()
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
    import uvicorn

    from .corpus import load_corpus
    from .retrieval import build_index

    index = build_index(load_corpus(corpus), method)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit this on Linux. Without it a server handed a pre-bound socket answers
    # each request ~40 ms late (Nagle + delayed ACK): measured 46 ms vs 5 ms per GET on loopback.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    url_host = f"[{host}]" if family == socket.AF_INET6 else host
    config = uvicorn.Config(create_app(index), log_level=log_level, access_log=False)
    server = uvicorn.Server(config)
    print(f"{READY_PREFIX}http://{url_host}:{bound} ({len(index)} documents, {method})", flush=True)
    server.run(sockets=[sock])


class RetrieverProcess:
    """A running retrieval server child: `.url` (http://host:port), `.retrieve_url`, `.stop()`."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path):
        self.proc, self.url, self.log_path = proc, url, log_path

    @property
    def retrieve_url(self) -> str:
        return self.url + "/retrieve"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def __enter__(self) -> "RetrieverProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_retriever(corpus_path: str | Path, *, host: str = "127.0.0.1", port: int = 0, method: str = "bm25",
                    timeout: float = 120.0, log_dir: Optional[str | Path] = None) -> RetrieverProcess:
    """Start `asyncrl retriever serve` as a child process and wait until it answers /health."""
    import httpx

    corpus = Path(corpus_path).expanduser().resolve()
    if not corpus.is_file():
        raise FileNotFoundError(f"retriever corpus {str(corpus_path)!r} not found (resolved to {corpus})")
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="asyncrl-retriever-"))
    log_path = log_dir / "retriever.log"
    cmd = [sys.executable, "-m", "asyncrl.cli", "retriever", "serve", "--corpus", str(corpus), "--host", host,
           "--port", str(port), "--method", method]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True)
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # read the announcement, then keep draining stdout so the child never blocks
        assert proc.stdout is not None
        for line in proc.stdout:
            if not url and line.startswith(READY_PREFIX):
                url.append(line[len(READY_PREFIX):].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True, name="retriever-stdout").start()
    deadline = time.monotonic() + timeout
    ready.wait(timeout)
    if not url:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise RuntimeError(f"retrieval server did not start (exit code {proc.returncode}); command: "
                           f"{' '.join(cmd)}; log {log_path}:\n{_log_tail(log_path)}")
    handle = RetrieverProcess(proc, url[0], log_path)
    while True:
        try:
            if httpx.get(handle.url + "/health", timeout=5.0).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"retrieval server at {handle.url} never became healthy; log {log_path}:\n"
                               f"{_log_tail(log_path)}")
        time.sleep(0.1)
