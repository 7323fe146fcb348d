"""Delta weight sync (asyncrl/weight_sync/delta.py): the rules as pure functions, then real syncs from the
real LearnerWorker (tiny model, trained by AdamW between syncs) to real embedded engine processes over a
real gloo group, with the engines' weights read back over HTTP and compared bit for bit."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from asyncrl.config import Config, ModelConfig
from asyncrl.engine.launcher import launch_embedded
from asyncrl.util.auth import auth_headers
from asyncrl.weight_sync import WeightSender
from asyncrl.weight_sync import delta as deltas
from asyncrl.weight_sync.broadcast import GroupTransport
from asyncrl.weight_sync.bucketing import metas_of
from asyncrl.weight_sync.receiver import Invalid, parse_delta

BUCKET = 1 << 16  # 64 KiB: the tiny model's embedding travels alone, the rest in several buckets

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------------- rules

def test_a_tensor_travels_left_out_sparse_or_whole_by_the_byte_rule():
    base = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert deltas.plan("w", base.clone(), base) is None  # nothing changed: left out
    few = base.clone()
    few[[3, 77, 299]] += 1
    p = deltas.plan("w", few, base)
    assert p.positions.tolist() == [3, 77, 299] and p.positions.dtype == torch.int32 and p.count == 3
    assert torch.equal(p.values, few[[3, 77, 299]]) and p.nbytes == 3 * (4 + 2)
    # bf16: sparse pays while k * 6 < n * 2, i.e. k < 100 of 300
    at = base.clone()
    at[:99] += 1
    assert deltas.plan("w", at, base).count == 99
    at[99] += 1
    assert deltas.plan("w", at, base).count == deltas.WHOLE and deltas.plan("w", at, base).nbytes == 600
    assert deltas.plan("w", few, None).count == deltas.WHOLE  # no base for it: whole
    assert deltas.plan("w", few, base.float()).count == deltas.WHOLE  # a base of another dtype: whole
    assert deltas.plan("w", few.view(3, 100), base).count == deltas.WHOLE  # or of another shape
    assert not deltas.sparse_pays(1, 2 ** 31, 2)  # int32 positions cannot address it


def test_changes_are_bitwise_negative_zero_and_nan_payloads_included():
    base = torch.tensor([0.0, float("nan"), 1.0])
    new = base.clone()
    new[0] = -0.0
    new.view(torch.int32)[1] = base.view(torch.int32)[1] + 1  # another NaN
    assert deltas.changed_positions(new, base).tolist() == [0, 1]
    assert deltas.changed_positions(base.clone(), base).tolist() == []


def test_the_wire_layout_round_trips_whole_and_sparse_tensors_of_several_dtypes():
    g = torch.Generator().manual_seed(1)
    bases = {"a": torch.randn(40, 8, generator=g).to(torch.bfloat16), "b": torch.randn(50, generator=g),
             "c": torch.randn(7, generator=g).to(torch.bfloat16), "d": torch.randn(300, generator=g).to(torch.bfloat16)}
    news = {k: v.clone() for k, v in bases.items()}
    news["a"].view(-1)[[0, 5, 319]] = 2.0  # sparse bf16
    news["b"][:] = news["b"] * 2  # whole fp32
    news["c"][:] += 1  # whole bf16
    news["d"][[10, 20]] = -3.0  # sparse bf16
    items = [deltas.plan(k, news[k], bases[k]) for k in news]
    assert [p.count for p in items] == [3, deltas.WHOLE, deltas.WHOLE, 2]
    metas = metas_of([(p.name, p.tensor) for p in items])
    counts = [p.count for p in items]
    bufs = deltas.wire_buffers(items)
    assert [(b.numel(), b.dtype) for b in bufs] == deltas.wire_specs(metas, counts) == [
        (50, torch.float32), (7, torch.bfloat16), (5, torch.int32), (5, torch.bfloat16)]
    received = [b.clone() for b in bufs]  # what a receiver holds after the broadcasts
    for name, got in zip(news, deltas.unpack_wire(metas, counts, received)):
        out = got if isinstance(got, torch.Tensor) else deltas.rebuilt(bases[name], *got)
        assert torch.equal(deltas.bits(out), deltas.bits(news[name])), name
        assert deltas.checksum(out) == deltas.checksum(news[name])


def test_the_checksum_sees_a_flipped_bit_values_moved_across_blocks_or_lanes_and_the_shape():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.int16)[517] ^= 1
    moved = t.clone()
    moved[[3, 900]] = t[[900, 3]]  # two values swapped across blocks: the same total
    lanes = t.clone()
    lanes[[0, 1]] = t[[1, 0]]  # two neighbours swapped inside one int64 word
    assert t[0] != t[1]
    digests = {deltas.checksum(x) for x in (t, flipped, moved, lanes, t.view(10, 100))}
    assert len(digests) == 5 and deltas.checksum(t.clone()) == deltas.checksum(t)
    assert deltas.checksum(torch.zeros(0)) != deltas.checksum(torch.zeros(1))


def test_a_position_outside_the_tensor_is_refused_not_written():
    live = torch.zeros(10)
    with pytest.raises(IndexError, match="delta position 10 outside a tensor of 10"):
        deltas.rebuilt(live, torch.tensor([2, 10], dtype=torch.int32), torch.ones(2))
    with pytest.raises(IndexError, match="-1"):
        deltas.rebuilt(live, torch.tensor([-1], dtype=torch.int32), torch.ones(1))
    assert not live.any()


@pytest.mark.parametrize("raw, match", [
    ([1], "must be an object"),
    ({"counts": [1], "checksums": ["x"]}, "must be an object"),  # no base
    ({"base": "s:1", "counts": [1, 2], "checksums": ["x"]}, "lists of 1 entries"),
    ({"base": "s:1", "counts": [5], "checksums": ["x"]}, "0..4"),  # more changes than elements
    ({"base": "s:1", "counts": [-2], "checksums": ["x"]}, "-1 \\(whole\\)"),
    ({"base": "s:1", "counts": [True], "checksums": ["x"]}, "-1 \\(whole\\)"),
    ({"base": "s:1", "counts": [1.0], "checksums": ["x"]}, "-1 \\(whole\\)"),
    ({"base": "s:1", "counts": [2], "checksums": [""]}, "non-empty"),
    ({"base": "s:1", "counts": [2], "checksums": [7]}, "must be a string"),
], ids=["array", "no-base", "lengths", "too-many", "negative", "bool", "float", "empty-sum", "int-sum"])
def test_hostile_delta_fields_are_invalid(raw, match):
    metas = metas_of([("w", torch.zeros(2, 2))])
    with pytest.raises(Invalid, match=match):
        parse_delta(raw, metas)
    assert parse_delta(None, metas) is None
    assert parse_delta({"base": "s:1", "counts": [-1], "checksums": [""]}, metas).counts == [-1]


# ---------------------------------------------------------------------------------------------- real syncs

def engine_weights(url: str, names_shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> dict:
    """The named tensors of the engine, read back (GET /get_weights_by_name answers float32, exact for bf16
    and fp32; its truncate_size is rows) up to each shape's first dimension, in `dtype`."""
    out = {}
    with httpx.Client(timeout=120, headers=auth_headers()) as c:
        for name, shape in names_shapes:
            r = c.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": shape[0] if shape else 1})
            r.raise_for_status()
            out[name] = torch.tensor(r.json(), dtype=torch.float32).reshape(shape).to(dtype)
    return out


def assert_bit_equal(url: str, learner, dtype: torch.dtype, rows: int | None = None) -> None:
    """The engine holds the learner's weights cast to `dtype`, bit for bit: every tensor, or of each only its
    first `rows` rows (reading the tiny model's 49,152-row embedding back costs about 3 s)."""
    params = [(n, p.detach().to(dtype)[:rows]) for n, p in learner.model.named_parameters()]
    got = engine_weights(url, [(n, tuple(p.shape)) for n, p in params], dtype)
    for n, want in params:
        assert torch.equal(deltas.bits(got[n]), deltas.bits(want)), f"{url}: {n} differs from the learner's"


@pytest.fixture()
def learner(tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker

    return LearnerWorker(Config(model=ModelConfig(path=str(tiny_model_dir))), rank=0, world_size=1)


def step(learner, opt, seed: int) -> None:
    """One real AdamW step on the tiny model's own loss over random tokens."""
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    learner.model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


async def test_twenty_delta_syncs_leave_a_bf16_engine_bit_equal_to_the_learner(learner, tiny_model_dir):
    """At the default run's learning rate (1e-6) with fp32 masters, a bf16 engine: the first sync is full,
    the next 19 move a fraction of its bytes, and the engine then holds the learner's weights cast to bf16
    bit for bit, its delta base the sender's."""
    opt = torch.optim.AdamW(learner.model.parameters(), lr=1e-6)
    with launch_embedded(tiny_model_dir, threads=1, dtype="bfloat16") as engine:
        transport = GroupTransport("gloo", timeout_s=60, delta="on")
        sender = WeightSender(transport, timeout_s=60)
        await sender.connect([engine.url])
        reports = []
        try:
            for version in range(1, 21):
                if version > 1:
                    step(learner, opt, version)
                reports.append(await sender.sync(learner.iter_full_params(BUCKET), version=version))
        finally:
            await sender.close()
        assert all(r.ok for r in reports)
        full = sum(p.numel() * 2 for p in learner.model.parameters())
        assert (reports[0].delta, reports[0].bytes, reports[0].full_bytes) == (False, full, full)
        assert all(r.delta and r.full_bytes == full and 0 < r.bytes < full / 3 for r in reports[1:]), \
            [(r.delta, r.bytes) for r in reports]
        assert reports[-1].metrics()["sync/delta"] == 1.0
        info = httpx.get(engine.url + "/weight_sync_info", timeout=10).json()
        assert info["weight_version"] == "20" and info["delta_base"] == transport.base_token == f"{transport.sender_id}:20"
        assert_bit_equal(engine.url, learner, torch.bfloat16)


async def test_a_member_that_lost_the_base_makes_the_next_sync_full_and_both_bit_equal(learner, tiny_model_dir):
    """b's weights are set by an update outside the tracked syncs (a sender without deltas, as SGLang's own
    format), so it no longer holds the base: the next sync sends every tensor to both."""
    opt = torch.optim.AdamW(learner.model.parameters(), lr=1e-6)
    with launch_embedded(tiny_model_dir, threads=1, dtype="bfloat16") as a, \
            launch_embedded(tiny_model_dir, threads=1, dtype="bfloat16") as b:
        sender = WeightSender(GroupTransport("gloo", timeout_s=60, delta="on"), timeout_s=60)
        await sender.connect([a.url, b.url])
        try:
            first = await sender.sync(learner.iter_full_params(BUCKET), version=1)
            step(learner, opt, 1)
            second = await sender.sync(learner.iter_full_params(BUCKET), version=2)
            other = WeightSender(GroupTransport("gloo", timeout_s=60, delta="off"), timeout_s=60)
            await other.connect([b.url])
            try:
                assert (await other.sync(learner.iter_full_params(BUCKET), version=2)).ok
            finally:
                await other.close()
            assert httpx.get(b.url + "/weight_sync_info", timeout=10).json()["delta_base"] is None
            step(learner, opt, 2)
            third = await sender.sync(learner.iter_full_params(BUCKET), version=3)
            step(learner, opt, 3)
            fourth = await sender.sync(learner.iter_full_params(BUCKET), version=4)
        finally:
            await sender.close()
        assert [(r.ok, r.delta) for r in (first, second, third, fourth)] == [
            (True, False), (True, True), (True, False), (True, True)]
        assert third.bytes == third.full_bytes and second.bytes < second.full_bytes
        for url in (a.url, b.url):
            assert_bit_equal(url, learner, torch.bfloat16, rows=2048)


async def test_fp32_engines_get_full_syncs_and_the_sender_keeps_no_copy(learner, tiny_model_dir):
    """An fp32 engine changes every value each step (a delta would be the whole model plus positions):
    deltas are not negotiated, no base is kept, every sync is full and exact."""
    opt = torch.optim.AdamW(learner.model.parameters(), lr=1e-6)
    with launch_embedded(tiny_model_dir, threads=1) as engine:
        transport = GroupTransport("gloo", timeout_s=60, delta="on")
        sender = WeightSender(transport, timeout_s=60)
        await sender.connect([engine.url])
        try:
            first = await sender.sync(learner.iter_full_params(BUCKET), version=1)
            step(learner, opt, 1)
            second = await sender.sync(learner.iter_full_params(BUCKET), version=2)
        finally:
            await sender.close()
        assert transport.cast_to == torch.float32 and not transport.delta and transport.base == {}
        assert all(r.ok and not r.delta and r.bytes == r.full_bytes for r in (first, second))
        assert_bit_equal(engine.url, learner, torch.float32, rows=2048)


async def test_a_delta_that_does_not_hash_as_sent_is_refused_then_a_full_sync_mends_it(learner, tiny_model_dir,
                                                                                        monkeypatch):
    """A fault in the delta (here the sender's checksums, corrupted for one sync): the engine applies none
    of the refused bucket and keeps its version; the sync is reported failed with code delta_mismatch; the
    next sync is full and leaves the engine bit-equal at the new version."""
    opt = torch.optim.AdamW(learner.model.parameters(), lr=1e-6)
    with launch_embedded(tiny_model_dir, threads=1, dtype="bfloat16") as engine:
        sender = WeightSender(GroupTransport("gloo", timeout_s=60, delta="on"), timeout_s=60)
        await sender.connect([engine.url])
        try:
            assert (await sender.sync(learner.iter_full_params(BUCKET), version=1)).ok
            step(learner, opt, 1)
            with monkeypatch.context() as m:
                m.setattr(deltas, "checksum", lambda t: "0" * 16)
                bad = await sender.sync(learner.iter_full_params(BUCKET), version=2)
            version_after_bad = httpx.get(engine.url + "/model_info", timeout=10).json()["weight_version"]
            step(learner, opt, 2)
            mended = await sender.sync(learner.iter_full_params(BUCKET), version=3)
        finally:
            await sender.close()
        assert not bad.ok and bad.delta and bad.engines_failed[engine.url].code == "delta_mismatch"
        assert "checksum mismatch" in str(bad.engines_failed[engine.url]) and version_after_bad == "1"
        assert mended.ok and not mended.delta and mended.bytes == mended.full_bytes
        assert httpx.get(engine.url + "/model_info", timeout=10).json()["weight_version"] == "3"
        assert_bit_equal(engine.url, learner, torch.bfloat16, rows=2048)
        assert math.isfinite(mended.seconds)
