"""What every asyncrl HTTP server (the engine, the OpenAI proxy, the retriever) bounds per connection and
per request, whoever the caller is.

uvicorn on its own waits forever for a request's headers (5,000 half-sent requests held an engine's
connections for over a minute), reads any body whole into memory before the app sees a byte of it, and
keeps generating for a client that left. Here:

- `server_config`: a uvicorn config whose connections must send their whole request line and headers
  within `header_timeout_s` of connecting (or of their previous response), else they are closed
  (`HeaderDeadlineH11`); headers at most `MAX_HEADER_BYTES`; at most `max_connections` connections at
  once (503 beyond: uvicorn's limit_concurrency); idle keep-alive connections closed after 60 s.
- `read_body`: a request's body, refused as `BodyTooLarge` (413) once it passes the server's limit,
  whatever Content-Length says, and as `BodyTooSlow` (408) when it has not all arrived within
  `timeout_s`; the caller maps both to its own error format.
- `until_disconnected`: resolves when the client closes its connection, so a handler can abort the work
  it started for that client (the engine aborts the generation).
- TCP_NODELAY on every accepted connection: asyncio sets it only where the socket's protocol number is
  TCP's, and uvicorn's listening socket has 0; without it each keep-alive request after the first waited
  about 40 ms for its reply (Nagle against the client's delayed ACK).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # request line and headers, from connect (or the previous response) to the last header
BODY_TIMEOUT_S = 60.0  # a whole body, from the headers to its last byte
MAX_HEADER_BYTES = 64 * 1024
MAX_CONNECTIONS = 1024
KEEP_ALIVE_S = 60


class BodyError(Exception):
    """A request body the server will not read: `status` is the HTTP status to answer."""

    status = 400


class BodyTooLarge(BodyError):
    status = 413


class BodyTooSlow(BodyError):
    status = 408


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: a connection that has not completed
    its request line and headers within `header_timeout_s` of connecting, or of its previous response,
    is closed. (uvicorn's own keep-alive timer is disarmed by the first byte of the next request, so a
    client that sends one byte a minute holds a connection, and a task slot, forever.)"""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._head_deadline: Optional[asyncio.TimerHandle] = None
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's head arrived whole: its handler has started
            self._disarm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head is due within the deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)


def server_config(app: Any, *, max_connections: int = MAX_CONNECTIONS, header_timeout_s: Optional[float] = None,
                  **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for `app` with the bounds above (`header_timeout_s` None: HEADER_TIMEOUT_S); `kwargs`
    go to uvicorn.Config (log_level, lifespan...)."""
    deadline = HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s
    protocol = type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": deadline})
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("access_log", False)
    return uvicorn.Config(app, http=protocol, limit_concurrency=max_connections, timeout_keep_alive=KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **kwargs)


async def read_body(request: Any, limit: int, *, what: str, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body of `request` (a Starlette Request), at most `limit` bytes (checked against Content-Length first,
    then as it streams in, so no more than `limit` bytes are ever held), all of it within `timeout_s`.
    `what` says where the limit comes from, for the error."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {int(declared)} bytes is over this server's limit of {limit} bytes "
                           f"({what})")
    chunks: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body over this server's limit of {limit} bytes ({what})")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTooSlow(f"request body not received within {timeout_s:g} s ({size} bytes arrived)") from None
    return b"".join(chunks)


async def until_disconnected(request: Any) -> None:
    """Returns once the client of `request` (a Starlette Request whose body was read) has disconnected."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
