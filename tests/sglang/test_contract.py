"""asyncrl's EngineClient and launcher probes against SGLang 0.5.23's real HTTP app (see conftest):
the contract the embedded engine imitates, checked on SGLang's side of the wire."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import answers
from asyncrl.util.auth import auth_headers
from tests.sglang.conftest import skip_without_sglang

pytestmark = [pytest.mark.sglang, skip_without_sglang]


async def _until(pred, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def _post(url: str, path: str, body) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as h:
        return await h.post(url + path, json=body)


@pytest.mark.timeout(60)
async def test_spans_across_an_in_place_update_expand_per_token(sglang_app):
    tm, url = sglang_app.tm, sglang_app.url
    async with EngineClient(url) as c:
        task = asyncio.create_task(c.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=60)))
        await _until(lambda: tm.tokens_out >= 5)
        assert (await _post(url, "/pause_generation", {"mode": "in_place"})).status_code == 200
        k = tm.tokens_out
        r = await _post(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
        assert r.status_code == 200, r.text
        await _post(url, "/continue_generation", {})
        res = await task
    assert res.finish_reason == "length" and res.versions == [0] * k + [1] * (60 - k)
    assert res.weight_version == 1 and len(res.logprobs) == 60 and c.continued == 0


@pytest.mark.timeout(60)
async def test_sync_abort_is_continued_and_a_user_abort_takes_the_exact_rid(sglang_app):
    tm, url = sglang_app.tm, sglang_app.url
    async with EngineClient(url) as c:
        task = asyncio.create_task(c.generate([4, 5], SamplingParams(temperature=0, max_new_tokens=60), rid="ep-t1"))
        await _until(lambda: tm.tokens_out >= 5)
        await _post(url, "/pause_generation", {"mode": "abort"})
        assert not any(r.dispatched for r in tm.live.values())  # it returns once every started request ended
        k = tm.tokens_out
        await _until(lambda: len(tm.rids) == 2)  # the continuation, held while paused
        await _post(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
        await _post(url, "/continue_generation", {})
        res = await task
    assert res.finish_reason == "length" and len(res.output_ids) == 60 and c.continued == 1
    assert res.versions == [0] * k + [1] * (60 - k)
    assert all(r.endswith("-ep-t1") for r in tm.rids) and len(set(tm.rids)) == 2

    # a user abort: SGLang answers 200 with an empty body whatever the rid; a prefix of a live rid is not
    # one the tokenizer holds, so nothing is aborted; the exact rid ends the generation as abort (no
    # status: the client would continue it; rounds=0)
    async with EngineClient(url, max_abort_rounds=0) as c:
        task = asyncio.create_task(c.generate([4], SamplingParams(max_new_tokens=100000), rid="user"))
        await _until(lambda: any(r.endswith("-user") for r in tm.live))
        rid = next(r for r in tm.live if r.endswith("-user"))
        r = await _post(url, "/abort_request", {"rid": rid[:8]})
        assert r.status_code == 200 and r.content == b""
        k = tm.tokens_out
        await _until(lambda: tm.tokens_out > k + 5)
        assert not task.done() and rid in tm.live
        r = await _post(url, "/abort_request", {"rid": rid})
        assert r.status_code == 200 and r.content == b""
        res = await task
    assert res.finish_reason == "abort" and tm.aborts[-2:] == [(rid[:8], False), (rid, False)]


@pytest.mark.timeout(60)
async def test_retry_after_5xx_uses_a_fresh_rid_and_a_live_duplicate_is_400(sglang_app):
    tm, url = sglang_app.tm, sglang_app.url
    tm.fail_next = [503, 500]
    async with EngineClient(url, backoff_s=0.01) as c:
        res = await c.generate([7, 8], SamplingParams(max_new_tokens=4), rid="u-t1")
    assert len(res.output_ids) == 4 and c.retries == 2
    assert len(tm.rids) == 3 and len(set(tm.rids)) == 3
    assert not any(a != b and b.startswith(a) for a in tm.rids for b in tm.rids)

    body = {"input_ids": [1], "rid": "dup", "sampling_params": {"max_new_tokens": 100000}}
    first = asyncio.create_task(_post(url, "/generate", body))
    await _until(lambda: "dup" in tm.live)
    r = await _post(url, "/generate", body)
    assert r.status_code == 400 and "Duplicate request ID detected: dup" in r.text
    await _post(url, "/abort_request", {"rid": "dup"})
    assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.timeout(60)
async def test_sampling_seed_is_sglangs_name_and_seed_is_refused(sglang_app):
    url = sglang_app.url
    ok = await _post(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 3}})
    assert ok.status_code == 200, ok.text
    bad = await _post(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "seed": 3}})
    assert bad.status_code == 400 and "unknown field `seed`" in bad.text
    async with EngineClient(url) as c:  # what the client sends passes SGLang's contract gate
        res = await c.generate([1, 2], SamplingParams(temperature=0.5, top_k=-1, max_new_tokens=3, min_new_tokens=1,
                                                      stop_token_ids=[2], sampling_seed=11))
    assert len(res.output_ids) == 3


@pytest.mark.timeout(60)
async def test_paused_engine_fails_health_but_answers_model_info(sglang_app):
    url = sglang_app.url
    await _post(url, "/pause_generation", {"mode": "in_place"})
    try:
        async with httpx.AsyncClient(timeout=30) as h:
            assert (await h.get(url + "/health")).status_code == 503  # SGLang's /health generates a token
            info = await h.get(url + "/model_info")
        assert info.status_code == 200 and info.json()["weight_version"] == "0"
        assert await asyncio.to_thread(answers, url)
        async with EngineClient(url) as c:
            assert await c.weight_versions() == [0]
    finally:
        await _post(url, "/continue_generation", {})


def test_sglang_reads_the_launchers_key_file(tmp_path, sglang_config):
    """What launch_sglang writes is what SGLang's own argument parser turns into its admin key."""
    from sglang.srt.server_args import prepare_server_args

    from asyncrl.engine.launcher import sglang_key_config

    token = "k" * 43
    keys = sglang_key_config(tmp_path, "127.0.0.1", token)
    args = prepare_server_args(["--model-path", sglang_config.model_path, "--config", str(keys)])
    assert args.admin_api_key == token and args.api_key is None
