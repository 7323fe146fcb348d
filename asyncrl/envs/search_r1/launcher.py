"""Run the retrieval server (`asyncrl retriever serve`) as a real child process and wait until it serves.

`start_retriever(corpus_path, host=, port=0, method=)`: with port 0 the child binds a free port itself
and announces it on its stdout (`READY_PREFIX` + url), so there is no race between picking and
binding a port. This module is light (no FastAPI, no index): the env imports it in the trainer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx

READY_PREFIX = "asyncrl-retriever listening on "


class RetrieverProcess:
    """A running retrieval server child: `.url` (http://host:port), `.retrieve_url`, `.stop()`. `scratch`: the
    temporary log dir the launch made itself (no `log_dir` given), removed by `stop()`."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, scratch: Optional[Path] = None):
        self.proc, self.url, self.log_path, self.scratch = proc, url, log_path, scratch

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
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> RetrieverProcess:
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
    corpus = Path(corpus_path).expanduser().resolve()
    if not corpus.is_file():
        raise FileNotFoundError(f"retriever corpus {str(corpus_path)!r} not found (resolved to {corpus})")
    scratch = None if log_dir else Path(tempfile.mkdtemp(prefix="asyncrl-retriever-"))
    log_path = Path(log_dir or scratch) / "retriever.log"
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
        tail = _log_tail(log_path)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise RuntimeError(f"retrieval server did not start (exit code {proc.returncode}); command: "
                           f"{' '.join(cmd)}; its log:\n{tail}")
    handle = RetrieverProcess(proc, url[0], log_path, scratch)
    while True:
        try:
            if httpx.get(handle.url + "/health", timeout=5.0).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = _log_tail(log_path)
            handle.stop()
            raise RuntimeError(f"retrieval server at {handle.url} never became healthy; its log:\n{tail}")
        time.sleep(0.1)
