"""Weight sync end to end: the real LearnerWorker (tiny model) sends to real embedded engine
processes over a real gloo group; checks are token-by-token greedy outputs, reported versions, and
the SGLang 0.5 contract (sessions, string versions, HTTP 400 refusals) on the wire.

Every test stands alone: tests that need engines in a known state or that kill engines launch their
own (`fresh`); tests on the shared pair (`shared`) first sync the learner's full weights and assert
only what that sync decides; tests on the base engine (`untouched`) only send refusals or open and end
a session, and the fixture checks after each that it is still as launched. Neither order nor the other
tests matter.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from asyncrl.config import Config, ModelConfig, WeightSyncConfig
from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.util.auth import auth_headers
from asyncrl.weight_sync import WeightMismatchError, WeightSender, WeightSyncError, make_sender
from asyncrl.weight_sync.broadcast import GroupTransport
from asyncrl.weight_sync.bucketing import iter_buckets
from asyncrl.weight_sync.disk import DiskTransport

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


def version_of(url: str) -> str:
    v = httpx.get(url + "/model_info", timeout=10).json()["weight_version"]
    assert isinstance(v, str), v  # SGLang 0.5: a string
    return v


def info(url: str) -> dict:
    return httpx.get(url + "/weight_sync_info", timeout=10).json()


def paused(url: str) -> bool:
    return bool(httpx.get(url + "/stats", timeout=10).json()["paused"])


def gloo(timeout_s: float = 60, mode: str = "in_place") -> WeightSender:
    return WeightSender(GroupTransport("gloo", timeout_s=timeout_s), timeout_s=timeout_s, mode=mode)


async def full_sync(learner, urls: list[str], version: int):
    sender = gloo()
    await sender.connect(urls)
    try:
        return await sender.sync(learner.iter_full_params(BUCKET), version=version)
    finally:
        await sender.close()


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
def base_engine(tiny_model_dir):
    """An engine on the base weights that no test changes: `outputs` reads the base greedy outputs from
    it, `untouched` lends it to tests of refusals (checked after each that it is still as launched)."""
    proc = launch_embedded(tiny_model_dir, threads=1)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def outputs(learner, base_engine, tmp_path_factory):
    """(greedy outputs of the base weights, of the learner's weights): from the untouched base engine
    and from a fresh engine on the learner's HF export."""
    export = tmp_path_factory.mktemp("export")
    learner.export_hf(str(export))
    with launch_embedded(export, threads=1) as proc:
        base, ref = greedy(base_engine.url), greedy(proc.url)
    assert base != ref  # otherwise the token checks below could not fail
    return base, ref


@pytest.fixture(scope="module")
def disk_root(tmp_path_factory):
    """Where the shared engines may load weights from disk (their --weights-dir)."""
    return tmp_path_factory.mktemp("disk_root")


@pytest.fixture(scope="module")
def shared(tiny_model_dir, disk_root):
    """Two engines for tests that set all weights themselves before asserting anything."""
    with ThreadPoolExecutor(2) as ex:
        procs = list(ex.map(lambda _: launch_embedded(tiny_model_dir, threads=1, weights_dirs=[disk_root]), range(2)))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture()
def untouched(base_engine, outputs):
    """The base engine, for tests that send it refusals only (or open and end a session); afterwards it
    must still be as launched (version 0, no session, not paused, base greedy outputs), else it fails here."""
    yield base_engine
    url = base_engine.url
    state = (version_of(url), info(url)["session_open"], paused(url), greedy(url) == outputs[0])
    assert state == ("0", False, False, True), f"a test left the shared base engine changed: {state}"


@pytest.fixture()
def fresh(tiny_model_dir):
    """launch(n) -> n engines of this test's own on the base weights; stopped at the end."""
    procs = []

    def launch(n: int):
        with ThreadPoolExecutor(n) as ex:
            new = list(ex.map(lambda _: launch_embedded(tiny_model_dir, threads=1), range(n)))
        procs.extend(new)
        return new

    yield launch
    for p in procs:
        p.stop()


async def test_gloo_sync_equals_fresh_engine_from_export(fresh, learner, outputs):
    base_out, ref_out = outputs
    engines = fresh(2)
    urls = [e.url for e in engines]
    assert all(greedy(u) == base_out and version_of(u) == "0" for u in urls)
    report = await full_sync(learner, urls, 1)
    assert report.ok and report.engines_ok == urls and report.engines_failed == {}
    n_params = sum(1 for _ in learner.model.named_parameters())
    assert report.bytes == sum(p.numel() * 4 for p in learner.model.parameters())
    assert report.buckets == len(list(learner.iter_full_params(BUCKET))) >= 3
    assert report.collectives == report.buckets < n_params  # coalesced (extension): one flat float32 buffer per bucket
    for u in urls:
        assert greedy(u) == ref_out and version_of(u) == "1"
        assert not info(u)["session_open"] and not paused(u)
        r = httpx.post(u + "/generate", json={"input_ids": [5, 6], "sampling_params": GREEDY}, timeout=60).json()
        assert r["meta_info"]["weight_version"] == "1" and {s["version"] for s in r["meta_info"]["weight_versions"]} == {"1"}


async def test_a_bf16_engine_takes_the_fp32_learner_cast_to_bf16_on_the_wire(learner, tiny_model_dir, tmp_path):
    """engine.dtype=auto serves bf16 on this CPU while the learner keeps fp32: the sender learns the engines'
    dtype (GET /weight_sync_info, asyncrl extension), casts floating tensors to it before the broadcast,
    and the engine then answers as a bf16 engine launched on the learner's export."""
    learner.export_hf(str(tmp_path / "export"))
    with launch_embedded(tiny_model_dir, threads=1, dtype="bfloat16") as engine, \
            launch_embedded(tmp_path / "export", threads=1, dtype="bfloat16") as ref:
        assert info(engine.url)["dtype"] == "bfloat16"
        sender = gloo()
        await sender.connect([engine.url])
        try:
            report = await sender.sync(learner.iter_full_params(BUCKET), version=3)
            assert report.ok and sender.transport.cast_to == torch.bfloat16
            # trainer.weight_sync.delta=auto: no deltas over loopback (finding changes costs more than moving bytes)
            assert not sender.transport.delta and not report.delta and report.bytes == report.full_bytes
        finally:
            await sender.close()
        assert greedy(engine.url) == greedy(ref.url) and version_of(engine.url) == "3"


async def test_sglang_wire_format_without_extensions_gives_the_same_weights(shared, learner, outputs):
    """coalesce=False: one broadcast per tensor, as the sender talks to a real SGLang."""
    urls = [e.url for e in shared]
    sender = WeightSender(GroupTransport("gloo", timeout_s=60, coalesce=False), timeout_s=60)
    await sender.connect(urls)
    try:
        report = await sender.sync(learner.iter_full_params(BUCKET), version=7)
    finally:
        await sender.close()
    assert report.ok and report.collectives == sum(1 for _ in learner.model.named_parameters())
    assert all(greedy(u) == outputs[1] and version_of(u) == "7" for u in urls)


@pytest.mark.parametrize("bad,needle", [
    (("model.norm.weight", torch.zeros(3)), "weight 'model.norm.weight': sender shape [3] != engine shape [64]"),
    (("model.not_a_layer.weight", torch.zeros(64)), "weight 'model.not_a_layer.weight' is not a tensor"),
    (("model.norm.weight", torch.zeros(64, dtype=torch.int32)), "weight 'model.norm.weight': sender dtype int32"),
], ids=["shape", "name", "dtype"])
async def test_refused_bucket_raises_ends_the_session_and_keeps_the_group(shared, learner, outputs, bad, needle):
    urls = [e.url for e in shared]
    sender = gloo()
    await sender.connect(urls)
    try:
        assert (await sender.sync(learner.iter_full_params(BUCKET), version=20)).ok
        good = [("model.layers.0.input_layernorm.weight", torch.full((64,), 3.0))]
        with pytest.raises(WeightMismatchError) as err:
            await sender.sync(iter([good + [bad]]), version=99)
        assert err.value.code == "refused" and err.value.status == 400 and err.value.url in urls
        assert needle in err.value.message
        for u in urls:  # nothing applied, no version bump; session ended, generation continued
            assert version_of(u) == "20" and greedy(u) == outputs[1]
            assert not info(u)["session_open"] and not paused(u)
        name = sender.transport.group_name  # the group survives a refused bucket
        report = await sender.sync(learner.iter_full_params(BUCKET), version=21)
        assert report.ok and sender.transport.group_name == name
    finally:
        await sender.close()
    assert all(version_of(u) == "21" for u in urls)


async def test_updates_outside_a_session_are_refused_with_400(untouched):
    url = untouched.url
    dist = {"names": [], "dtypes": [], "shapes": [], "group_name": "g", "weight_version": "5"}
    tensor = {"serialized_named_tensors": ["AA=="], "weight_version": "5"}
    for path, body in [("/update_weights_from_distributed", dist), ("/update_weights_from_tensor", tensor),
                       ("/end_weight_update", {})]:
        r = httpx.post(url + path, json=body, timeout=10, headers=auth_headers())
        assert r.status_code == 400 and r.json()["success"] is False, (path, r.text)
    try:
        assert httpx.post(url + "/begin_weight_update", json={}, timeout=10, headers=auth_headers()).status_code == 200
        second = httpx.post(url + "/begin_weight_update", json={}, timeout=10, headers=auth_headers())
        assert second.status_code == 400 and second.json()["success"] is False
        # inside the session: no such group is a refusal too (before any broadcast)
        r = httpx.post(url + "/update_weights_from_distributed", json=dist, timeout=10, headers=auth_headers())
        assert r.status_code == 400 and r.json()["success"] is False
        assert httpx.post(url + "/end_weight_update", json={}, timeout=10, headers=auth_headers()).status_code == 200
    finally:  # a failure above must not leave the shared engine's session open
        if info(url)["session_open"]:
            httpx.post(url + "/end_weight_update", json={}, timeout=10, headers=auth_headers())
    assert version_of(url) == "0" and not info(url)["session_open"]


def test_get_weights_by_name_answers_as_sglang_and_refuses_the_rest(untouched, tiny_model_dir):
    """The read-back route (weight_sync/verify.py): SGLang's answer shape, its 400 for an unknown name,
    the run's token required (SGLang: ADMIN_OPTIONAL), hostile bodies refused without touching the model."""
    from safetensors import safe_open

    url = untouched.url + "/get_weights_by_name"
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    r = httpx.post(url, json={"name": "model.embed_tokens.weight", "truncate_size": 2}, timeout=10, headers=auth_headers())
    assert r.status_code == 200 and torch.tensor(r.json()).shape == (2, emb.shape[1]), r.text[:200]
    assert torch.equal(torch.tensor(r.json()), emb[:2].float())
    r = httpx.request("GET", url, json={"name": "model.norm.weight", "truncate_size": 10**12}, timeout=10,
                      headers=auth_headers())  # a huge truncate_size is the whole tensor
    assert r.status_code == 200 and len(r.json()) == emb.shape[1]
    r = httpx.post(url, json={"name": "model.layers.99.mlp.weight"}, timeout=10, headers=auth_headers())
    assert r.status_code == 400 and r.json() == {"error": {"message": "Get parameter by name failed"}}
    assert httpx.post(url, json={"name": "model.norm.weight"}, timeout=10).status_code == 401
    for body in [{"name": 3}, {"name": "model.norm.weight", "truncate_size": -1},
                 {"name": "model.norm.weight", "truncate_size": True}, {"name": "x", "truncate_size": 1.5}, [1]]:
        r = httpx.post(url, json=body, timeout=10, headers=auth_headers())
        assert r.status_code == 400 and "success" not in r.json(), (body, r.text)
    r = httpx.post(url, content=b"{not json", timeout=10, headers=auth_headers())
    assert r.status_code == 400


@pytest.mark.parametrize("body", [
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 5},  # an int, not a string
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": "v5"},  # not this engine's
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[1], [2]]},
    {"names": ["a"], "dtypes": ["complex7"], "shapes": [[1]]},
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "flush_cache": "yes"},
    {"dtypes": [], "shapes": []},
    [1, 2],
    "{not json",
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[4]], "asyncrl_track": 5},
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[4]], "asyncrl_coalesce": True,  # a delta needs a track
     "asyncrl_delta": {"base": "s:1", "counts": [1], "checksums": ["x"]}},
    {"names": ["a"], "dtypes": ["float32"], "shapes": [[4]], "asyncrl_coalesce": True, "asyncrl_track": "s:2",
     "asyncrl_delta": {"base": "s:1", "counts": [2 ** 40], "checksums": ["x"]}},  # more changes than elements
], ids=["int-version", "foreign-version", "lengths", "dtype", "flush-type", "no-names", "array", "bad-json",
        "track-type", "delta-untracked", "delta-count"])
def test_malformed_update_requests_are_400_without_success_and_harmless(untouched, body):
    eng = untouched
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(eng.url + "/update_weights_from_distributed", timeout=10, headers=auth_headers(), **kw)
    assert r.status_code == 400 and "success" not in r.json() and r.json()["message"]
    assert version_of(eng.url) == "0" and greedy(eng.url)


async def test_killed_engine_is_left_out_and_the_survivor_is_closed_and_resumed(fresh, learner, outputs):
    a, b = fresh(2)
    sender = gloo(timeout_s=8)
    await sender.connect([a.url, b.url])

    def killing_b_after_first_bucket():
        for i, bucket in enumerate(learner.iter_full_params(BUCKET)):
            if i == 1:
                os.kill(b.pid, signal.SIGKILL)
                b.proc.wait()
            yield bucket

    try:
        report = await sender.sync(killing_b_after_first_bucket(), version=60)
        assert not report.ok and report.engines_ok == [] and report.engines_failed[b.url].engine_is_down
        # the abandoned sync still ended a's session and let it generate again
        assert not info(a.url)["session_open"] and not paused(a.url) and version_of(a.url) == "0"
        report = await sender.sync(learner.iter_full_params(BUCKET), version=61)
    finally:
        await sender.close()
    assert report.engines_ok == [a.url] and report.engines_failed[b.url].code == "unreachable"
    assert sender.transport.members == [] and version_of(a.url) == "61"  # close() retired the group
    assert greedy(a.url) == outputs[1]


async def test_a_session_left_open_by_a_dead_sender_is_closed_and_reopened(shared, learner, outputs):
    eng = shared[0]  # the sync below sets all its weights, as every test on `shared` does
    assert httpx.post(eng.url + "/begin_weight_update", json={}, timeout=10, headers=auth_headers()).status_code == 200
    report = await full_sync(learner, [eng.url], 3)
    assert report.ok and version_of(eng.url) == "3" and greedy(eng.url) == outputs[1]
    assert not info(eng.url)["session_open"]


@pytest.mark.heavy(24)
async def test_engine_restarted_on_its_address_rejoins_the_next_sync(fresh, learner, tiny_model_dir, outputs):
    a, b = fresh(2)
    port = int(b.url.rsplit(":", 1)[1])
    b.stop()
    sender = gloo(timeout_s=30)
    left_out = await sender.connect([a.url, b.url])  # b is dead: a group of rank 0 + a
    assert list(left_out) == [b.url] and sender.transport.members == [a.url]
    b2 = await asyncio.to_thread(launch_embedded, tiny_model_dir, port=port, threads=1)
    try:
        assert b2.url == b.url and greedy(b2.url) == outputs[0]
        report = await sender.sync(learner.iter_full_params(BUCKET), version=62)
        assert report.ok and report.engines_ok == [a.url, b.url]
        assert greedy(b2.url) == outputs[1] and version_of(b2.url) == "62"
        # the same address restarted again loses the group: the sender notices and rebuilds
        b2.stop()
        b2 = await asyncio.to_thread(launch_embedded, tiny_model_dir, port=port, threads=1)
        report = await sender.sync(learner.iter_full_params(BUCKET), version=63)
        assert report.ok and report.engines_ok == [a.url, b.url] and version_of(b2.url) == "63"
    finally:
        await sender.close()
        b2.stop()


async def _inflight_during_sync(url: str, urls: list[str], learner, mode: str) -> tuple[dict, int]:
    """A 1500-token greedy request decoding on `url` (through EngineClient, which continues a
    generation a sync in abort mode cut short) while all engines sync; (its result, old version)."""
    version = int(version_of(url)) + 1
    async with httpx.AsyncClient(trust_env=False) as client, EngineClient(url) as engine:
        sp = SamplingParams(temperature=0.0, max_new_tokens=1500, min_new_tokens=1500)
        task = asyncio.ensure_future(engine.generate([1, 2, 3], sp))
        while (await client.get(url + "/stats")).json()["running"] == 0:  # the request is decoding now
            await asyncio.sleep(0.02)
        sender = gloo(mode=mode)
        await sender.connect(urls)
        try:
            report = await sender.sync(learner.iter_full_params(BUCKET), version=version)
        finally:
            await sender.close()
        assert report.ok
        res = await task
        return {"output_ids": res.output_ids, "versions": res.versions, "finish_reason": res.finish_reason,
                "continued": engine.continued}, version - 1


async def test_abort_mode_partial_output_is_continued_on_new_weights(shared, learner):
    urls = [e.url for e in shared]
    out, v = await _inflight_during_sync(urls[0], urls, learner, "abort")
    assert out["continued"] == 1 and out["finish_reason"] == "length" and len(out["output_ids"]) == 1500
    k = out["versions"].index(v + 1)  # tokens before the switch carry v, after it v + 1, never mixed back
    assert 0 < k < 1500 and out["versions"] == [v] * k + [v + 1] * (1500 - k)


async def test_in_place_mode_keeps_the_request_running_across_the_switch(shared, learner):
    """in_place is sent as SGLang's retract (requests kept, cache flushable); this engine keeps them running."""
    urls = [e.url for e in shared]
    out, v = await _inflight_during_sync(urls[1], urls, learner, "in_place")
    assert out["continued"] == 0 and out["finish_reason"] == "length" and len(out["output_ids"]) == 1500
    k = out["versions"].index(v + 1)
    assert 0 < k < 1500 and out["versions"] == [v] * k + [v + 1] * (1500 - k)


async def test_disk_transport_loads_the_shards(shared, tiny_model_dir, outputs, disk_root):
    from safetensors.torch import load_file

    tmp_path = Path(tempfile.mkdtemp(dir=disk_root))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    url = shared[0].url
    sender = WeightSender(DiskTransport(str(tmp_path), timeout_s=60), timeout_s=60)
    await sender.connect([url])
    try:
        report = await sender.sync(iter_buckets(base.items(), BUCKET), version=50)  # the base weights
    finally:
        await sender.close()
    assert report.ok and report.buckets >= 2 and (tmp_path / "v50" / "model.safetensors.index.json").is_file()
    assert greedy(url) == outputs[0] and version_of(url) == "50" and not paused(url)


async def test_empty_weights_are_a_config_error_that_still_closes_and_resumes(shared):
    urls = [e.url for e in shared]
    sender = gloo()
    await sender.connect(urls)
    try:
        with pytest.raises(WeightSyncError, match="no tensors") as err:
            await sender.sync(iter([]), version=5)
    finally:
        await sender.close()
    assert err.value.code == "config"
    assert all(not info(u)["session_open"] and not paused(u) for u in urls)


def test_sender_handle_is_what_the_learner_actor_calls(shared, learner, outputs):
    """make_sender(cfg, rank, urls).sync_blocking(worker, version), as LearnerActor.sync_weights does;
    rank > 0 only walks the (collective) gather and sends nothing."""
    url = shared[0].url
    cfg = WeightSyncConfig(transport="auto", bucket_mb=1, timeout_s=60)
    handle = make_sender(cfg, rank=0, engine_urls=[url])
    try:
        assert handle.sync_blocking(learner, 70)["sync/ok"] == 1.0
        other = make_sender(cfg, rank=1, engine_urls=[url])
        assert other.sync_blocking(learner, 71) == {} and version_of(url) == "70"
        m = handle.sync_blocking(learner, 72)
    finally:
        handle.close()
    assert handle.sender is None
    assert m["sync/ok"] == 1.0 and m["sync/engines_ok"] == 1.0 and m["sync/engines_failed"] == 0.0
    assert m["sync/buckets"] == 2.0  # 12.6 MB embedding alone (> 1 MiB), then the rest
    assert version_of(url) == "72" and greedy(url) == outputs[1]
