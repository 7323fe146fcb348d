"""asyncrl/util/http_server.py on a real uvicorn server over a real socket: the head deadline, the body's size
and time bounds, and the disconnect signal, each against a hostile client."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from asyncrl.util.http_server import (
    BodyError,
    HeaderDeadlineH11,
    read_body,
    server_config,
    until_disconnected,
)
from asyncrl.util.net import bind_socket

DEADLINE_S = 0.5
LIMIT = 1000


@pytest.fixture
def served():
    """A real uvicorn server (server_config, head deadline 0.5 s) on loopback in a thread: yields (host, port,
    events), events holding what the handlers saw."""
    app = FastAPI()
    events: list[str] = []

    @app.exception_handler(BodyError)
    async def _body(request: Request, exc: BodyError):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.post("/echo")
    async def echo(request: Request):
        body = await read_body(request, LIMIT, what="the test's limit", timeout_s=2 * DEADLINE_S)
        return {"size": len(body)}

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(4 * DEADLINE_S)  # longer than the head deadline: only heads are timed
        return {"ok": True}

    @app.post("/wait")
    async def wait(request: Request):
        await read_body(request, LIMIT, what="the test's limit")
        events.append("waiting")
        await until_disconnected(request)
        events.append("disconnected")
        return {}

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(server_config(app, header_timeout_s=DEADLINE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield "127.0.0.1", sock.getsockname()[1], events
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _closed_by_server(conn: socket.socket) -> bool:
    """True when the server closes `conn` (recv sees EOF) within 30 s; False when it keeps it open."""
    conn.settimeout(30)
    try:
        while data := conn.recv(4096):
            if b"HTTP/1.1 " in data and b"\r\n\r\n" in data:
                continue  # a full response (keep-alive): read on
        return True
    except TimeoutError:
        return False


def _read_reply(conn: socket.socket) -> bytes:
    """One whole HTTP response (head and its Content-Length body) from `conn`, however it is segmented."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.mark.timeout(60)
def test_a_half_sent_head_is_closed_at_the_deadline_and_whole_ones_are_served(served):
    host, port, _ = served
    silent = socket.create_connection((host, port))  # connects, sends nothing
    trickle = socket.create_connection((host, port))
    trickle.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
    # a slow handler is not cut: the deadline is for heads, and this one arrived whole
    assert httpx.get(f"http://{host}:{port}/slow", timeout=30).json() == {"ok": True}
    assert _closed_by_server(silent) and _closed_by_server(trickle)
    # after a response the next head on the same connection is due within the deadline too
    kept = socket.create_connection((host, port))
    kept.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    kept.settimeout(30)
    assert b"200 OK" in kept.recv(4096)
    kept.sendall(b"GET /slow HTTP/1.1\r\n")
    assert _closed_by_server(kept)


@pytest.mark.timeout(60)
async def test_a_body_past_the_limit_is_413_by_length_or_as_it_streams_and_a_trickle_is_408(served):
    host, port, _ = served
    url = f"http://{host}:{port}/echo"
    async with httpx.AsyncClient(timeout=30) as h:
        assert (await h.post(url, content=b"x" * LIMIT)).json() == {"size": LIMIT}
        r = await h.post(url, content=b"x" * (LIMIT + 1))
        assert r.status_code == 413 and f"of {LIMIT + 1} bytes is over this server's limit of {LIMIT}" in r.text

        async def chunks():
            for _ in range(10):
                yield b"x" * 400

        r = await h.post(url, content=chunks())  # chunked: no Content-Length to refuse it by
        assert r.status_code == 413 and "content-length" not in r.request.headers, r.text
    # within the limit, but half of it never comes: answered 408 once the body's time is up
    conn = socket.create_connection((host, port))
    conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 800\r\n\r\n" + b"x" * 400)
    conn.settimeout(30)
    reply = await asyncio.to_thread(_read_reply, conn)
    conn.close()
    assert reply.startswith(b"HTTP/1.1 408 ") and b"not received within 1 s (400 bytes arrived)" in reply, reply


@pytest.mark.timeout(60)
def test_a_handler_learns_that_its_client_left(served):
    host, port, events = served
    conn = socket.create_connection((host, port))
    conn.sendall(b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    deadline = time.monotonic() + 30
    while "waiting" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["waiting"]
    conn.close()
    while "disconnected" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["waiting", "disconnected"]


def test_every_connection_sends_without_nagle_delay(served):
    """The server sets TCP_NODELAY on each connection it accepts. Without it a keep-alive client waited about
    40 ms for every reply after the first (the head and the body go out as two segments; Nagle holds the
    second until the first is acknowledged, and the client delays that ACK): 44 ms per call to an engine,
    a weight sync of 8 calls 0.40 s against 0.06 s (docs/benchmarks.md). asyncio sets the option itself
    only on sockets whose protocol number says TCP, which uvicorn's listening socket (proto 0) does not."""
    host, port, _ = served
    with httpx.Client() as client:
        client.get(f"http://{host}:{port}/slow", timeout=10)  # keep-alive: the connection stays open
        live = [p for p in gc.get_objects() if issubclass(type(p), HeaderDeadlineH11) and not p.transport.is_closing()]
        assert live
        sockets = [p.transport.get_extra_info("socket") for p in live]
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
