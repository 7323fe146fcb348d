"""Clients of the replay buffer: `AsyncBufferProducer` (rollout workers, zmq.asyncio) and
`BufferConsumer` (learner rank 0 / controller, blocking with timeouts).

Both use one DEALER socket and tag each request with a fresh ``req_id``; replies are matched by it,
so late replies to abandoned requests are recognised and ignored (a late *batch* is kept and returned
by the next `get_batch`, so no served batch is lost while the consumer lives).

Producer guarantees: `put` returns only after the buffer acknowledged the WAL append. A request
that gets no reply within `timeout_s` is sent again with the same trajectory (same uid; the buffer
stores a uid once) up to `retries` times; a BUSY reply (back-pressure) makes it wait and retry without
limit, since waiting for the learner to drain is the intended behaviour. A FULL reply (the buffer's disk
is full: nothing was stored) makes it wait with capped exponential backoff (`FULL_WAIT_S` doubling up to
`FULL_WAIT_MAX_S`) and retry without limit: the trajectory is never dropped. It logs one warning when
an episode of refusals begins and one line when acks come back.

Each takes a `BufferEndpoint` (or a bare address for a buffer without CURVE): with CURVE, the socket
authenticates with the endpoint's client key pair, which the buffer admits only if it is on its
allow-list (one pair for producers, one for the consumer: asyncrl/buffer/keys.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from asyncrl.buffer import protocol as P
from asyncrl.buffer.keys import BufferEndpoint
from asyncrl.data.schema import Batch, Trajectory

log = logging.getLogger(__name__)

BUSY_WAIT_S = 0.05  # first wait after a back-pressure reply (doubles up to 1 s)
FULL_WAIT_S, FULL_WAIT_MAX_S = 0.1, 5.0  # first and longest wait after a disk-full refusal


class BufferError(RuntimeError):
    """The buffer refused a request (ERR reply) or never answered within the retries."""


class BufferTimeout(BufferError, TimeoutError):
    pass


def _endpoint(endpoint: str | BufferEndpoint) -> BufferEndpoint:
    ep = endpoint if isinstance(endpoint, BufferEndpoint) else BufferEndpoint(endpoint)
    if not ep.address.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"buffer address {ep.address!r} must look like tcp://host:port")
    return ep


def _curve(sock: zmq.Socket, ep: BufferEndpoint) -> None:
    if ep.client is not None:
        sock.curve_serverkey = ep.server_public.encode()
        sock.curve_publickey, sock.curve_secretkey = ep.client.public.encode(), ep.client.secret.encode()


def _ids():
    prefix = os.urandom(4)
    return (prefix + i.to_bytes(8, "little") for i in itertools.count())


class AsyncBufferProducer:
    """Many coroutines may `put` concurrently on one producer: puts waiting at the same moment are
    coalesced into one PUTS request (one message, one server round, one ack list), which is what lets
    a worker with many agent loops stream at close to socket speed while every put is still acked
    individually after its WAL append."""

    MAX_COALESCE = 256
    MAX_COALESCE_BYTES = 16 << 20

    def __init__(self, endpoint: str | BufferEndpoint, *, timeout_s: float = 10.0, retries: int = 20):
        self._endpoint = _endpoint(endpoint)
        self.address, self.timeout_s, self.retries = self._endpoint.address, timeout_s, retries
        self._sock: zmq.asyncio.Socket | None = None
        self._waiting: dict[bytes, tuple[float, list[asyncio.Future], bool]] = {}  # req_id -> (t, futs, is_puts)
        self._outbox: list[tuple[bytes, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._ids = _ids()
        self.busy_waits = 0
        self.full_waits = 0  # disk-full refusals waited out
        self._full_since: float | None = None  # when the current episode of disk-full refusals began
        self.resends = 0
        self.requests = 0

    def _ensure(self) -> None:
        if self._sock is None:
            s = zmq.asyncio.Context.instance().socket(zmq.DEALER)  # shared: see `BufferConsumer`
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 10_000)
            _curve(s, self._endpoint)
            s.connect(self.address)
            self._sock = s
            self._wake = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read()), loop.create_task(self._send_puts())]

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            entry = self._waiting.pop(frames[0], None)
            if entry is None:
                continue  # a late reply to a request we gave up on
            _, futs, is_puts = entry
            status, body = frames[1], frames[2]
            if not is_puts:
                results = [(status, body)]
            elif status == P.OK:
                results = msgspec.msgpack.decode(body, type=list[str])
            else:
                results = [f"err: {body.decode(errors='replace')}"] * len(futs)
            for fut, res in zip(futs, results):
                if not fut.done():
                    fut.set_result(res)

    async def _send_puts(self) -> None:
        """Drain the outbox: everything queued goes out as PUTS requests of up to MAX_COALESCE items."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                n, size = 0, 0
                while n < len(self._outbox) and n < self.MAX_COALESCE and size < self.MAX_COALESCE_BYTES:
                    size += len(self._outbox[n][0])
                    n += 1
                items, self._outbox = self._outbox[:n], self._outbox[n:]
                items = [(b, f) for b, f in items if not f.done()]  # timed out meanwhile: resent by put
                if not items:
                    continue
                req_id = next(self._ids)
                self._waiting[req_id] = (time.monotonic(), [f for _, f in items], True)
                self.requests += 1
                await self._sock.send_multipart([req_id, P.PUTS, *(b for b, _ in items)], copy=False)
            self._purge()

    def _purge(self) -> None:
        """Forget requests whose replies are long overdue (their puts were resent)."""
        if len(self._waiting) > 1000:
            old = time.monotonic() - 2 * self.timeout_s
            for k in [k for k, (t, _, _) in self._waiting.items() if t < old]:
                del self._waiting[k]

    async def _await(self, fut: asyncio.Future):
        async with asyncio.timeout(self.timeout_s):
            return await fut

    async def put_bytes(self, body: bytes) -> str:
        """Send an already encoded trajectory; returns after the ack with the buffer's verdict:
        'new' | 'dup' (already stored: a resend) | 'late' (its group was already served).
        Resends after `timeout_s` without reply (same bytes, same uid), up to `retries` times; waits
        and resends without limit while the buffer answers 'busy' (back-pressure) or 'full: ...' (its
        disk is full)."""
        self._ensure()
        loop = asyncio.get_running_loop()
        attempts, backoff, full_wait = 0, 0.0, 0.0
        while True:
            fut = loop.create_future()
            self._outbox.append((body, fut))
            self._wake.set()
            try:
                verdict = await self._await(fut)
            except TimeoutError:
                fut.cancel()
                attempts += 1
                self.resends += 1
                if attempts > self.retries:
                    raise BufferTimeout(f"buffer at {self.address} did not ack a put after {attempts} tries "
                                        f"of {self.timeout_s}s") from None
                continue
            if verdict == "busy":
                self.busy_waits += 1
                backoff = min(1.0, max(BUSY_WAIT_S, backoff * 2))
                await asyncio.sleep(backoff)
                continue
            if verdict.startswith("full: "):
                self.full_waits += 1
                if self._full_since is None:
                    self._full_since = time.monotonic()
                    log.warning("buffer at %s refuses puts (%s); retrying with backoff, nothing is dropped",
                                self.address, verdict[6:])
                full_wait = min(FULL_WAIT_MAX_S, max(FULL_WAIT_S, full_wait * 2))
                await asyncio.sleep(full_wait)
                continue
            if verdict.startswith("err: "):
                raise BufferError(f"buffer at {self.address} refused a put: {verdict[5:]}")
            if self._full_since is not None:
                log.warning("buffer at %s acks puts again after %.1f s of disk-full refusals", self.address,
                            time.monotonic() - self._full_since)
                self._full_since = None
            return verdict

    async def put(self, traj: Trajectory) -> str:
        """Send one trajectory; the buffer's verdict (`put_bytes`)."""
        return await self.put_bytes(msgspec.msgpack.encode(traj))

    async def _request(self, op: bytes, body: bytes) -> tuple[bytes, bytes]:
        """One non-PUT request; resent on timeout up to `retries` times."""
        self._ensure()
        loop = asyncio.get_running_loop()
        for _ in range(self.retries + 1):
            req_id = next(self._ids)
            fut = loop.create_future()
            self._waiting[req_id] = (time.monotonic(), [fut], False)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._sock.send_multipart([req_id, op, body])
                    status, reply = await fut
            except TimeoutError:
                self._waiting.pop(req_id, None)
                self.resends += 1
                continue
            if status == P.ERR:
                raise BufferError(f"buffer at {self.address} refused {op.decode()}: {reply.decode(errors='replace')}")
            return status, reply
        raise BufferTimeout(f"buffer at {self.address} did not answer {op.decode()} after {self.retries + 1} "
                            f"tries of {self.timeout_s}s")

    async def report_failed(self, group_id: str, group_size: int, count: int = 1) -> None:
        """`count` members of `group_id` will never arrive; the group completes with its real size."""
        key = uuid.uuid4().hex  # one per report: a resend of this report is applied once
        await self._request(P.FAIL, P.pack(P.FailReport(key, group_id, group_size, count)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception as e:  # a background task that died: say so, the socket is closed anyway
                log.warning("buffer producer task %s had failed: %r", t.get_name(), e)
        self._tasks = []
        for _, futs, _ in self._waiting.values():
            for f in futs:
                f.cancel()
        self._waiting.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class BufferConsumer:
    """Blocking client for learner rank 0 / the controller (not thread-safe: one thread uses it)."""

    REQUEST_TRIES = 3
    GRACE_S = 2.0  # how long past a GET's deadline the client still waits for the parked reply

    def __init__(self, endpoint: str | BufferEndpoint, *, timeout_s: float = 10.0):
        ep = _endpoint(endpoint)
        self.address, self.timeout_s = ep.address, timeout_s
        # The process's one shared context, never a context of its own: a client dropped without close()
        # can end in a reference cycle, and the garbage collector clears the weak references by which a
        # context finds its sockets before the context's __del__ runs its term(), which then waits forever
        # for sockets it can no longer close (it hung a later test in the collector). The shared instance
        # is never collected; a client closes only its socket (linger 0).
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))  # never block forever on a send
        _curve(self._sock, ep)
        self._sock.connect(ep.address)
        self._ids = _ids()
        self._late_batches: list[list] = []

    def _wait_reply(self, req_id: bytes, deadline: float) -> tuple[bytes, list] | None:
        """(status, body frames) of the reply to `req_id`, or None at the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(left * 1000):
                return None
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) < 3:
                continue
            rid, status = frames[0].bytes, frames[1].bytes
            if rid == req_id:
                return status, frames[2:]
            if status == P.BATCH:  # a batch for a GET we gave up on: keep it, it was served
                self._late_batches.append(frames[2:])

    def _send(self, frames: list[bytes]) -> bool:
        try:
            self._sock.send_multipart(frames)
            return True
        except zmq.Again:  # no connected peer within SNDTIMEO
            return False

    def _call(self, op: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
        for _ in range(self.REQUEST_TRIES):
            req_id = next(self._ids)
            if not self._send([req_id, op, body]):
                continue
            got = self._wait_reply(req_id, time.monotonic() + self.timeout_s)
            if got is None:
                continue
            status, body = got[0], got[1][0].bytes
            if status == P.ERR:
                raise BufferError(f"buffer at {self.address} refused {op.decode()}: {body.decode(errors='replace')}")
            return status, body
        raise BufferTimeout(f"buffer at {self.address} did not answer {op.decode()} in "
                            f"{self.REQUEST_TRIES} tries of {self.timeout_s}s")

    def get_batch(self, n_groups: int, current_version: int, max_staleness: int | None = None,
                  timeout_s: float = 60.0) -> Batch | None:
        """`n_groups` complete groups whose trajectories are all at least current_version - eta old (eta:
        the buffer's bound, set when it was built), or None if the buffer has not got them within
        `timeout_s`. `max_staleness`, if given, must equal the buffer's bound (else BufferError)."""
        if self._late_batches:
            return P.decode_batch([f.buffer for f in self._late_batches.pop(0)])
        req_id = next(self._ids)
        body = P.pack(P.GetRequest(n_groups, current_version, int(timeout_s * 1000), max_staleness))
        if not self._send([req_id, P.GET, body]):
            return None
        got = self._wait_reply(req_id, time.monotonic() + timeout_s + self.GRACE_S)
        if got is None:
            return None
        status, frames = got
        if status == P.BATCH:
            return P.decode_batch([f.buffer for f in frames])
        if status == P.EMPTY:
            return None
        raise BufferError(f"buffer at {self.address} refused GET: {frames[0].bytes.decode(errors='replace')}")

    def commit(self, batch_ids: list[int], step: int) -> None:
        """The learner trained on these batches and checkpointed at `step`: never serve them again."""
        self._call(P.COMMIT, P.pack(P.CommitRequest([int(b) for b in batch_ids], int(step))))

    def set_version(self, version: int) -> None:
        self._call(P.VERSION, P.pack(P.VersionRequest(int(version))))

    def stats(self) -> dict:
        return msgspec.msgpack.decode(self._call(P.STATS)[1])

    def close(self) -> None:
        self._sock.close(linger=0)
