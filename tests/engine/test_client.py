"""EngineClient against real servers: retries with fresh rids, routing, partial rollout across a
weight sync in abort mode; reply parsing (weight_versions spans) with hostile replies."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import (
    EngineClient,
    EngineRequestError,
    is_sync_abort,
    parse_generate_reply,
    parse_version,
)
from tests.engine.conftest import greedy_path, post, stats, teacher_forced_logprobs, wait_tokens


class FlakyProxy:
    """A real TCP server in front of an engine that fails the first `fail` requests (`mode` "503": an
    HTTP 503 reply; "drop": closes the connection without replying), then forwards requests
    unchanged. It records the rid of every attempt."""

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
                if len(self.attempts) <= self.fail:
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
async def test_client_retries_with_fresh_rids_never_prefixes(engine, tiny_model, mode):
    """SGLang refuses a live rid (400) and aborts by prefix: each attempt gets its own rid, and no rid
    is a prefix of another, even for caller rids like t1 / t10."""
    from tests.engine.conftest import greedy_reference

    proxy = FlakyProxy(engine.url, fail=2, mode=mode)
    url = await proxy.start()
    try:
        async with EngineClient(url, max_retries=3, backoff_s=0.01) as c:
            res = await c.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=6), rid="u-t1")
            assert res.output_ids == greedy_reference(tiny_model, [5, 6, 7], 6)
            assert len(proxy.attempts) == 3 and len(set(proxy.attempts)) == 3 and c.retries == 2
            await c.generate([5, 6], SamplingParams(temperature=0, max_new_tokens=2), rid="u-t10")
        rids = proxy.attempts
        assert all(r.endswith("-u-t1") for r in rids[:3]) and rids[3].endswith("-u-t10")
        assert not any(a != b and b.startswith(a) for a in rids for b in rids)
        proxy.attempts.clear()
        proxy.fail = 10
        async with EngineClient(url, max_retries=1, backoff_s=0.01) as c:
            with pytest.raises(EngineRequestError, match="after 2 attempts"):
                await c.generate([5, 6, 7], SamplingParams(max_new_tokens=2), rid="gives-up")
        assert len(proxy.attempts) == 2 and len(set(proxy.attempts)) == 2
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
    long = SamplingParams(temperature=0, max_new_tokens=4000, min_new_tokens=4000)
    short = SamplingParams(temperature=0, max_new_tokens=3)
    async with EngineClient(urls, backoff_s=0.01, max_abort_rounds=0) as c:
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
        for u in urls:
            await post(u, "/abort_request", {"abort_all": True})
        outs = await asyncio.gather(a1, c1, d1)
        assert [o.engine for o in outs] == [urls[0], urls[1], urls[0]]
        assert all(o.finish_reason == "abort" and 0 < len(o.output_ids) < 5000 for o in outs)
        assert all(len(o.logprobs) == len(o.versions) == len(o.output_ids) for o in outs)
        assert c.inflight == [0, 0]


@pytest.mark.timeout(60)
async def test_weight_versions_read_model_info_while_paused(engine, engine2):
    async with EngineClient([engine.url, engine2.url]) as c:
        await post(engine.url, "/pause_generation", {"mode": "in_place"})
        try:
            assert await c.weight_versions() == [0, 0]
        finally:
            await post(engine.url, "/continue_generation", {})


def _reply(out, spans, version="7", fr=None, lps=None):
    return {"text": "", "output_ids": out,
            "meta_info": {"id": "r", "finish_reason": fr or {"type": "length", "length": len(out)},
                          "output_token_logprobs": lps if lps is not None else [[-0.5, t, None] for t in out],
                          "weight_version": version, "weight_versions": spans}}


def test_parse_reply_expands_sglang_spans():
    spans = [{"version": "6", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 3}]
    r = parse_generate_reply(_reply([11, 12, 13], spans), engine="e")
    assert (r.output_ids, r.versions, r.finish_reason, r.weight_version) == ([11, 12, 13], [6, 6, 7], "length", 7)
    empty = parse_generate_reply(_reply([], [{"version": "7", "start": 0, "end": 0}]))
    assert empty.versions == [] and empty.weight_version == 7


@pytest.mark.parametrize("reply,needle", [
    (_reply([1, 2], None), "weight_versions must be a non-empty list"),  # never stamped with the last version
    (_reply([1, 2], [{"version": "default", "start": 0, "end": 2}]), "'default' is not an integer"),
    (_reply([1, 2], [{"version": "1.5", "start": 0, "end": 2}]), "'1.5' is not an integer"),
    (_reply([1, 2], [{"version": None, "start": 0, "end": 2}]), "None is not an integer"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 1}]), "cover 1 of 2"),
    (_reply([1, 2], [{"version": "1", "start": 1, "end": 2}]), "does not continue"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 10**12}]), "does not continue"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": "2"}]), "non-integer bounds"),
    (_reply([1, 2], [{"version": "1", "start": 0}]), "is not {version, start, end}"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 1}] * 100_000), "spans for 2 output tokens"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 2}], version="default"), "'default' is not an integer"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 2}], lps=[[-0.5, 1, None]]), "1 output_token_logprobs"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 2}], lps=[[-0.5, 1, None], [-1.0, 3, None]]), "disagree"),
    (_reply([1, "2"], [{"version": "1", "start": 0, "end": 2}]), "output_ids must be a list"),
    (_reply([1, 2], [{"version": "1", "start": 0, "end": 2}], fr={"type": "weird"}), "finish_reason"),
    ({"output_ids": [1]}, "no meta_info"),
    ([1, 2], "no meta_info"),
])
def test_parse_reply_refuses_hostile_replies(reply, needle):
    with pytest.raises(EngineRequestError, match=re.escape(needle)):
        parse_generate_reply(reply, engine="e")


def test_parse_version_names_the_value():
    assert parse_version("12", "x") == 12 and parse_version(3, "x") == 3
    for bad in ("default", "", "1e3", True, 2.0, None, ["1"]):
        with pytest.raises(EngineRequestError, match="weight version"):
            parse_version(bad, "x")


@pytest.mark.timeout(180)
async def test_partial_rollout_continues_across_a_sync_in_abort_mode(engine, engine_model_dir, tiny_model):
    """trainer.weight_sync.mode=abort: the engine is paused with mode abort mid-generation, gets new
    weights and continues. The client continues the aborted generation from its partial output on the
    new weights: one result, each token's version and logprob kept, the budget respected.
    On the shared engine: the "new" weights are its own checkpoint (the greedy path stays checkable), and
    its version goes back to 0 afterwards."""
    n = 400
    try:
        async with EngineClient(engine.url, max_abort_rounds=4) as c:
            prompt = [3, 1, 4, 1, 5]
            start = (await stats(engine.url))["tokens_out"]
            task = asyncio.create_task(c.generate(prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                                          min_new_tokens=n), rid="ep-t1"))
            await wait_tokens(engine.url, start + 5)
            await post(engine.url, "/pause_generation", {"mode": "abort"})
            # the sync: the same tensors again (the model directory is a weight root) at version 1
            r = await post(engine.url, "/update_weights_from_disk",
                           {"model_path": str(engine_model_dir), "weight_version": "1"})
            assert r.status_code == 200, r.text
            await post(engine.url, "/continue_generation", {})
            res = await task
        assert res.finish_reason == "length" and len(res.output_ids) == n and c.continued >= 1
        assert len(res.logprobs) == len(res.versions) == n
        k = res.versions.index(1)
        assert 5 <= k < n and res.versions == [0] * k + [1] * (n - k)
        assert greedy_path(tiny_model, prompt, res.output_ids) == res.output_ids
        ref = teacher_forced_logprobs(tiny_model, prompt, res.output_ids, 0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref)) < 1e-3
        assert res.weight_version == 1
    finally:  # the shared engine back to version 0, generating
        await post(engine.url, "/continue_generation", {})
        r = await post(engine.url, "/update_weights_from_disk", {"model_path": str(engine_model_dir), "weight_version": "0"})
        assert r.status_code == 200 and r.json()["success"] is True, r.text


@pytest.mark.timeout(60)
async def test_abort_with_a_status_code_or_no_rounds_ends_as_abort(engine):
    """Only a bare abort (what a sync leaves) is continued; with max_abort_rounds=0 nothing is."""
    async with EngineClient(engine.url, max_abort_rounds=0) as c:
        before = (await stats(engine.url))["tokens_out"]
        task = asyncio.create_task(c.generate([8, 8], SamplingParams(temperature=0, max_new_tokens=3000,
                                                                      min_new_tokens=3000)))
        await wait_tokens(engine.url, before + 3)
        await post(engine.url, "/abort_request", {"abort_all": True})
        res = await task
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 3000 and c.continued == 0
    sp = {"type": "abort", "message": "timeout", "status_code": 503}
    assert not is_sync_abort(_reply([1], [{"version": "1", "start": 0, "end": 1}], fr=sp))
    assert is_sync_abort(_reply([1], [{"version": "1", "start": 0, "end": 1}], fr={"type": "abort", "message": "Aborted"}))


@pytest.mark.timeout(60)
async def test_cancelled_generate_aborts_its_request_on_the_engine(engine):
    async with EngineClient(engine.url) as c:
        before = (await stats(engine.url))["tokens_out"]
        task = asyncio.create_task(c.generate([6, 6], SamplingParams(temperature=0, max_new_tokens=3000,
                                                                      min_new_tokens=3000)))
        await wait_tokens(engine.url, before + 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # close() waited for the abort: the engine runs nothing now
    s = await stats(engine.url)
    assert s["running"] == 0 and s["waiting"] == 0


def test_client_needs_a_url():
    with pytest.raises(ValueError, match="at least one engine URL"):
        EngineClient([])


async def test_a_retry_goes_to_the_url_the_engine_moved_to(engine, monkeypatch):
    """An engine relaunched on another node answers at a new URL (asyncrl/run/supervisor.py): a generation
    whose attempt failed at the old one retries at the new one, on the same router index."""
    from asyncrl.engine import client as client_module
    from asyncrl.util.net import free_port

    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the lost node's engine
    c = EngineClient([gone], max_retries=1, backoff_s=0.0)
    real_sleep = asyncio.sleep

    async def moved_while_backing_off(seconds: float) -> None:
        c.set_urls([engine.url])  # what RolloutActor.set_engine_urls does when the supervisor says so
        await real_sleep(0)

    monkeypatch.setattr(client_module.asyncio, "sleep", moved_while_backing_off)
    try:
        res = await c.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3, min_new_tokens=3))
    finally:
        monkeypatch.undo()
        await c.close()
    assert res.engine == engine.url and len(res.output_ids) == 3 and c.retries == 1
    with pytest.raises(ValueError, match="set_urls: 2 URLs for 1 engines"):
        c.set_urls([engine.url, gone])
