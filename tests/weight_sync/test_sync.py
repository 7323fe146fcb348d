"""Weight sync end to end: the real LearnerWorker (tiny model) sends to real embedded engine
processes over a real gloo group; checks are token-by-token greedy outputs and reported versions.

Tests in this module share two engines (A, B) and run in file order; versions only go up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch

from asyncrl.config import Config, ModelConfig
from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.weight_sync import WeightMismatchError
from asyncrl.weight_sync.bucketing import iter_buckets
from asyncrl.weight_sync.disk import DiskSender
from asyncrl.weight_sync.distributed import DistributedSender

PROMPTS = [[1, 2, 3, 4], [17, 900, 4242, 31, 8]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
BUCKET = 1 << 16  # 64 KiB: the tiny model's embedding travels alone, the rest in several buckets

pytestmark = pytest.mark.timeout(240)


def greedy(url: str) -> list[list[int]]:
    out = []
    for ids in PROMPTS:
        r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=60)
        r.raise_for_status()
        out.append(r.json()["output_ids"])
    return out


def generate_reply(url: str, ids: list[int]) -> dict:
    return httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=60).json()


def version_of(url: str) -> int:
    return int(httpx.get(url + "/model_info", timeout=10).json()["weight_version"])


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker

    w = LearnerWorker(Config(model=ModelConfig(path=str(tiny_model_dir))), rank=0, world_size=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the learner has moved away from the engines' starting weights
        for p in w.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return w


@pytest.fixture(scope="module")
def export_dir(learner, tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    learner.export_hf(str(d))
    return d


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, export_dir):
    """Engines A and B on the tiny model's weights, plus (briefly) a fresh engine loaded from the
    learner's exported checkpoint: its greedy outputs are the reference. Launched in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as ex:
        procs = list(ex.map(lambda d: launch_embedded(d, threads=1), [tiny_model_dir, tiny_model_dir, export_dir]))
    try:
        ref_out = greedy(procs[2].url)
    finally:
        procs[2].stop()
    yield procs[:2], ref_out
    for p in procs[:2]:
        p.stop()


@pytest.fixture(scope="module")
def engines(cluster):
    return cluster[0]


@pytest.fixture(scope="module")
def ref_out(cluster):
    return cluster[1]


@pytest.fixture(scope="module")
def base_out(engines):
    return greedy(engines[0].url)


async def test_gloo_sync_equals_fresh_engine_from_export(engines, learner, base_out, ref_out):
    urls = [e.url for e in engines]
    assert base_out != ref_out  # otherwise this test could not fail
    assert greedy(urls[1]) == base_out
    sender = DistributedSender("gloo", timeout_s=60)
    await sender.connect(urls)
    try:
        report = await sender.sync(learner.iter_full_params(BUCKET), version=1)
    finally:
        await sender.close()
    assert report.ok and report.engines_ok == urls and report.engines_failed == {}
    n_params = sum(1 for _ in learner.model.named_parameters())
    assert report.bytes == sum(p.numel() * 4 for p in learner.model.parameters())
    assert report.buckets == len(list(learner.iter_full_params(BUCKET))) >= 3
    assert report.collectives == report.buckets < n_params  # one flat float32 buffer per bucket
    for u in urls:
        assert greedy(u) == ref_out
        assert version_of(u) == 1
        r = generate_reply(u, [5, 6])
        assert r["meta_info"]["weight_version"] == "1" and {s["version"] for s in r["meta_info"]["weight_versions"]} == {"1"}


@pytest.mark.parametrize("bad,needle", [
    (("model.norm.weight", torch.zeros(3)), "weight 'model.norm.weight': sender shape [3] != engine shape [64]"),
    (("model.not_a_layer.weight", torch.zeros(64)), "weight 'model.not_a_layer.weight' is not a tensor"),
    (("model.norm.weight", torch.zeros(64, dtype=torch.float16)), "weight 'model.norm.weight': sender dtype float16"),
])
async def test_mismatch_is_an_error_naming_the_tensor_and_changes_nothing(engines, learner, ref_out, bad, needle):
    urls = [e.url for e in engines]
    sender = DistributedSender("gloo", timeout_s=60)
    await sender.connect(urls)
    try:
        v = version_of(urls[0])
        good = [("model.layers.0.input_layernorm.weight", torch.full((64,), 3.0))]
        with pytest.raises(WeightMismatchError) as err:
            await sender.sync(iter([good + [bad]]), version=99)
        assert needle in str(err.value)
        assert all(version_of(u) == v for u in urls)  # nothing applied, no version bump
        assert greedy(urls[0]) == ref_out
        # the group survives a refused bucket: the next sync goes through it
        name = sender.group_name
        report = await sender.sync(learner.iter_full_params(BUCKET), version=v + 1)
        assert report.ok and sender.group_name == name
    finally:
        await sender.close()
    assert all(version_of(u) == v + 1 for u in urls)


async def _inflight_during_sync(url: str, urls: list[str], learner, mode: str) -> tuple[dict, int]:
    """A 1500-token greedy request decoding on `url` (through EngineClient, which continues a
    generation a sync in abort mode cut short) while all engines sync; (its result, old version)."""
    version = version_of(url) + 1
    async with httpx.AsyncClient(trust_env=False) as client, EngineClient(url) as engine:
        sp = SamplingParams(temperature=0.0, max_new_tokens=1500, min_new_tokens=1500)
        task = asyncio.ensure_future(engine.generate([1, 2, 3], sp))
        while (await client.get(url + "/stats")).json()["running"] == 0:  # the request is decoding now
            await asyncio.sleep(0.02)
        sender = DistributedSender("gloo", timeout_s=60, mode=mode)
        await sender.connect(urls)
        try:
            report = await sender.sync(learner.iter_full_params(BUCKET), version=version)
        finally:
            await sender.close()
        assert report.ok
        res = await task
        return {"output_ids": res.output_ids, "versions": res.versions, "finish_reason": res.finish_reason,
                "continued": engine.continued}, version - 1


async def test_abort_mode_partial_output_is_continued_on_new_weights(engines, learner):
    urls = [e.url for e in engines]
    out, v = await _inflight_during_sync(urls[0], urls, learner, "abort")
    assert out["continued"] == 1 and out["finish_reason"] == "length" and len(out["output_ids"]) == 1500
    k = out["versions"].index(v + 1)  # tokens before the switch carry v, after it v + 1, never mixed back
    assert 0 < k < 1500 and out["versions"] == [v] * k + [v + 1] * (1500 - k)


async def test_in_place_mode_keeps_the_request_running_across_the_switch(engines, learner):
    urls = [e.url for e in engines]
    out, v = await _inflight_during_sync(urls[1], urls, learner, "in_place")
    assert out["continued"] == 0 and out["finish_reason"] == "length" and len(out["output_ids"]) == 1500
    k = out["versions"].index(v + 1)
    assert 0 < k < 1500 and out["versions"] == [v] * k + [v + 1] * (1500 - k)


async def test_disk_transport_loads_the_shards(engines, tiny_model_dir, base_out, ref_out, tmp_path):
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    url = engines[0].url
    sender = DiskSender(str(tmp_path), timeout_s=60)
    await sender.connect([url])
    report = await sender.sync(iter_buckets(base.items(), BUCKET), version=50)  # back to the base weights
    await sender.close()
    assert report.ok and report.buckets >= 2 and (tmp_path / "v50" / "model.safetensors.index.json").is_file()
    assert greedy(url) == base_out and version_of(url) == 50


async def test_killed_engine_is_abandoned_within_the_timeout_then_skipped(engines, learner, ref_out):
    a, b = engines
    sender = DistributedSender("gloo", timeout_s=8)
    await sender.connect([a.url, b.url])

    def killing_b_after_first_bucket():
        for i, bucket in enumerate(learner.iter_full_params(BUCKET)):
            if i == 1:
                os.kill(b.pid, signal.SIGKILL)
                b.proc.wait()
            yield bucket

    try:
        t0 = time.perf_counter()
        report = await sender.sync(killing_b_after_first_bucket(), version=60)
        t1 = time.perf_counter()
        assert t1 - t0 < 8 + 10, t1 - t0
        assert not report.ok and report.engines_ok == [] and b.url in report.engines_failed
        report = await sender.sync(learner.iter_full_params(BUCKET), version=61)
        print(f"abandoned sync {t1 - t0:.1f}s, next sync {time.perf_counter() - t1:.1f}s")
    finally:
        await sender.close()
    assert report.engines_ok == [a.url] and "/health failed" in report.engines_failed[b.url]
    assert sender.members == [] and version_of(a.url) == 61
    assert greedy(a.url) == ref_out


async def test_engine_restarted_on_its_address_rejoins_the_next_sync(engines, learner, tiny_model_dir, ref_out):
    a, b = engines
    sender = DistributedSender("gloo", timeout_s=30)
    await sender.connect([a.url, b.url])  # b is dead: a group of rank 0 + a
    assert sender.members == [a.url]
    port = int(b.url.rsplit(":", 1)[1])
    b2 = await asyncio.to_thread(launch_embedded, tiny_model_dir, port=port, threads=1)
    try:
        assert b2.url == b.url and greedy(b2.url) != ref_out
        report = await sender.sync(learner.iter_full_params(BUCKET), version=62)
        assert report.ok and report.engines_ok == [a.url, b.url]
        assert greedy(b2.url) == ref_out and version_of(b2.url) == 62
        # the same address restarted again loses the group: the sender notices and rebuilds
        b2.stop()
        b2 = await asyncio.to_thread(launch_embedded, tiny_model_dir, port=port, threads=1)
        report = await sender.sync(learner.iter_full_params(BUCKET), version=63)
        assert report.ok and report.engines_ok == [a.url, b.url] and version_of(b2.url) == 63
    finally:
        await sender.close()
        b2.stop()


def test_sender_handle_is_what_the_learner_actor_calls(engines, learner, ref_out):
    """make_sender(cfg, rank, urls).sync_blocking(worker, version), as LearnerActor.sync_weights does;
    rank > 0 only walks the (collective) gather and sends nothing."""
    from asyncrl.config import WeightSyncConfig
    from asyncrl.weight_sync import make_sender

    url = engines[0].url
    cfg = WeightSyncConfig(transport="auto", bucket_mb=1, timeout_s=60)
    other = make_sender(cfg, rank=1, engine_urls=[url])
    v = version_of(url)
    assert other.sync_blocking(learner, 70) == {} and version_of(url) == v
    handle = make_sender(cfg, rank=0, engine_urls=[url])
    try:
        m = handle.sync_blocking(learner, 70)
    finally:
        handle.close()
    assert handle.sender is None
    assert m["sync/ok"] == 1.0 and m["sync/engines_ok"] == 1.0 and m["sync/engines_failed"] == 0.0
    assert m["sync/buckets"] == 2.0  # 12.6 MB embedding alone (> 1 MiB), then the rest
    assert version_of(url) == 70 and greedy(url) == ref_out
