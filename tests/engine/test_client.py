"""EngineClient against real servers: retries with the same rid, routing, helpers; reply parsing."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient, EngineRequestError, parse_generate_reply


class FlakyProxy:
    """A real TCP server in front of an engine that fails the first `fail` attempts of each rid
    (`mode` "503": an HTTP 503 reply; "drop": closes the connection without replying), then
    forwards the request unchanged. It records the rid of every attempt."""

    def __init__(self, target: str, fail: int, mode: str):
        self.target, self.fail, self.mode = target, fail, mode
        self.attempts: list[str] = []
        self.server = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import httpx

        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = next((int(x.split(":", 1)[1]) for x in lines if x.lower().startswith("content-length")), 0)
                body = await reader.readexactly(length) if length else b""
                rid = json.loads(body).get("rid", "") if body else ""
                self.attempts.append(rid)
                if self.attempts.count(rid) <= self.fail:
                    if self.mode == "drop":
                        writer.close()
                        return
                    msg = b'{"error": "injected failure"}'
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(msg), msg))
                    await writer.drain()
                    continue
                async with httpx.AsyncClient() as h:
                    r = await h.request(method, self.target + path, content=body,
                                        headers={"content-type": "application/json"})
                writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (r.status_code, len(r.content), r.content))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["503", "drop"])
async def test_client_retries_with_the_same_rid(engine, tiny_model, mode):
    from tests.engine.conftest import greedy_reference

    proxy = FlakyProxy(engine.url, fail=2, mode=mode)
    url = await proxy.start()
    try:
        async with EngineClient(url, max_retries=3, backoff_s=0.01) as c:
            res = await c.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=6), rid=f"retry-{mode}")
            assert res.output_ids == greedy_reference(tiny_model, [5, 6, 7], 6)
            assert proxy.attempts == [f"retry-{mode}"] * 3 and c.retries == 2
        proxy.attempts.clear()
        async with EngineClient(url, max_retries=1, backoff_s=0.01) as c:
            with pytest.raises(EngineRequestError, match="after 2 attempts"):
                await c.generate([5, 6, 7], SamplingParams(max_new_tokens=2), rid="gives-up")
        assert proxy.attempts == ["gives-up", "gives-up"]
    finally:
        await proxy.stop()


@pytest.mark.timeout(60)
async def test_client_does_not_retry_4xx(engine):
    async with EngineClient(engine.url, max_retries=3, backoff_s=0.01) as c:
        with pytest.raises(EngineRequestError, match="HTTP 400.*temperature") as e:
            await c.generate([1], SamplingParams(temperature=-1.0))
        assert e.value.status == 400 and c.retries == 0


@pytest.mark.timeout(120)
async def test_router_least_loaded_then_sticky(engine, engine2):
    urls = [engine.url, engine2.url]
    long = SamplingParams(temperature=0, max_new_tokens=5000, min_new_tokens=5000)
    short = SamplingParams(temperature=0, max_new_tokens=3)
    async with EngineClient(urls, backoff_s=0.01) as c:
        a1 = asyncio.create_task(c.generate([1, 2, 3], long, session_id="a"))  # tie -> engine 0
        await asyncio.sleep(0)
        assert c.inflight == [1, 0]
        b1 = await c.generate([4, 5, 6], short, session_id="b")  # least loaded -> engine 1
        assert b1.engine == urls[1]
        c1 = asyncio.create_task(c.generate([7, 8], long, session_id="c"))  # [1, 0] -> engine 1
        await asyncio.sleep(0)
        d1 = asyncio.create_task(c.generate([9], long, session_id="d"))  # [1, 1] tie -> engine 0
        await asyncio.sleep(0)
        assert c.inflight == [2, 1]
        a2 = await c.generate([1, 2, 3, 4], short, session_id="a")  # least loaded is 1, but sticky: 0
        b2 = await c.generate([4, 5, 6, 7], short, session_id="b")
        assert (a2.engine, b2.engine) == (urls[0], urls[1])
        assert c.sessions == {"a": 0, "b": 1, "c": 1, "d": 0}
        await asyncio.sleep(0.3)
        await c.abort()  # abort_all on both engines
        outs = await asyncio.gather(a1, c1, d1)
        assert [o.engine for o in outs] == [urls[0], urls[1], urls[0]]
        assert all(o.finish_reason == "abort" and 0 < len(o.output_ids) < 5000 for o in outs)
        assert all(len(o.logprobs) == len(o.versions) == len(o.output_ids) for o in outs)
        assert c.inflight == [0, 0]


@pytest.mark.timeout(60)
async def test_helpers_over_all_engines(engine, engine2):
    async with EngineClient([engine.url, engine2.url]) as c:
        assert await c.health() == [True, True]
        assert await c.weight_versions() == [0, 0]
        await c.pause("in_place")
        task = asyncio.create_task(c.generate([1, 2], SamplingParams(temperature=0, max_new_tokens=3)))
        await asyncio.sleep(0.3)
        assert not task.done()
        await c.resume()
        assert len((await task).output_ids) == 3
    async with EngineClient(["http://127.0.0.1:9"], max_retries=0) as dead:
        assert await dead.health() == [False]


def test_parse_reply_fills_versions_for_sglang_replies():
    sglang_reply = {"text": "hi", "output_ids": [11, 12],
                    "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 2},
                                  "output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None]],
                                  "weight_version": "7"}}
    r = parse_generate_reply(sglang_reply, engine="e")
    assert (r.output_ids, r.logprobs, r.versions, r.finish_reason, r.weight_version) == (
        [11, 12], [-0.5, -1.25], [7, 7], "length", 7)
    ours = {**sglang_reply, "meta_info": {**sglang_reply["meta_info"], "output_token_versions": [6, 7]}}
    assert parse_generate_reply(ours).versions == [6, 7]
    default = {**sglang_reply, "meta_info": {**sglang_reply["meta_info"], "weight_version": "default"}}
    assert parse_generate_reply(default).versions == [0, 0]
    bad = {**sglang_reply, "output_ids": [11, 13]}
    with pytest.raises(EngineRequestError, match="disagree"):
        parse_generate_reply(bad)


def test_client_needs_a_url():
    with pytest.raises(ValueError, match="at least one engine URL"):
        EngineClient([])
