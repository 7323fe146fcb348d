"""The decode step that a GPU replays as a CUDA graph (engine/graphs.py), run on a CPU without capture:
the same function on the same static tensors, bucketed rows (padding rows that must stay finite),
widths in steps of 256 columns, a KV slab rebuilt inside its own buffers. Every output must be
transformers' own greedy continuation and every logprob its teacher-forced one, as for the eager
layouts (test_step_layouts.py). The capture itself needs a GPU: tests/engine/test_gpu.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import EngineConfig
from asyncrl.engine.graphs import WIDTH_STEP, row_bucket
from asyncrl.engine.kvbatch import KVSlots
from asyncrl.engine.protocol import GenRequest
from asyncrl.engine.scheduler import EngineCore
from tests.engine.conftest import greedy_reference, teacher_forced_logprobs

# rows joining and leaving (3, 5, 6 running: padded to 4 and 8), a shared prompt, a probe, and one row
# that runs past 256 columns (two attention widths)
WORK = [
    ([11, 12, 13, 14], 9), ([11, 12, 13, 14], 9), ([11, 12, 13, 14], 9), ([5, 6, 7], 24),
    (list(range(100, 140)), 6), ([9] * 7, 30), (list(range(300, 311)), 3), (list(range(500, 740)), 40),
    (list(range(700, 705)), 1), ([42], 17), (list(range(900, 960)), 5),
]


async def _serve_work(model, slots: int) -> tuple[EngineCore, list[GenRequest]]:
    core = EngineCore(model, EngineConfig(max_running_seqs=slots), prefill_tokens_per_step=300, graphs=True)
    assert core.graphs is not None and core.kv.fixed_buffers and core.admit_rows == max(1, slots // 8)
    core.start()
    try:
        reqs = [GenRequest(rid=f"r{i}", input_ids=p, temperature=0.0, max_new_tokens=n, min_new_tokens=n,
                           return_logprob=True) for i, (p, n) in enumerate(WORK)]
        await asyncio.wait_for(asyncio.gather(*(core.generate(r) for r in reqs)), 240)
    finally:
        await core.close()
    return core, reqs


def _check_work(core: EngineCore, reqs: list[GenRequest], reference, slots: int, tol: float) -> None:
    for (prompt, n), req in zip(WORK, reqs):
        assert req.output_ids == greedy_reference(reference, prompt, n), (prompt[:3], n)
        ref = teacher_forced_logprobs(reference, prompt, req.output_ids, 0.0)
        assert max(abs(a - b) for a, b in zip(req.logprobs, ref)) < tol
    for layer in core.kv.layers:  # what the padding rows wrote is finite (a masked NaN would poison a later row)
        assert bool(torch.isfinite(layer.kbuf).all()) and bool(torch.isfinite(layer.vbuf).all())
    assert core.kv.generation == 1  # the first buffers served the whole workload
    widths = {w for _, w in core.graphs.shapes}
    assert core.graphs.replays >= 30 and {WIDTH_STEP, 2 * WIDTH_STEP} <= widths
    assert any(rows > 1 for rows, _ in core.graphs.shapes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slots", [6, 16])
async def test_the_graph_step_gives_transformers_greedy_tokens_and_teacher_forced_logprobs(
        engine_model_dir, tiny_model, slots):
    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()
    core, reqs = await _serve_work(model, slots)
    _check_work(core, reqs, tiny_model, slots, 1e-4)


@pytest.mark.gpu
@pytest.mark.timeout(300)
async def test_captured_graphs_give_the_same_tokens_on_a_gpu(engine_model_dir, tiny_model):
    """The same workload with the steps captured and replayed (fp32 on the GPU, the CPU model the reference)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).to("cuda").eval()
    core, reqs = await _serve_work(model, 16)
    assert core.graphs.capture and core.graphs.captures == len(core.graphs.graphs) > 1
    _check_work(core, reqs, tiny_model, 16, 1e-3)


def test_row_buckets_cover_every_count_once():
    for max_rows in (1, 6, 16, 128, 130):
        for n in range(1, max_rows + 1):
            b = row_bucket(n, max_rows)
            assert n <= b <= max_rows
        assert len({row_bucket(n, max_rows) for n in range(1, max_rows + 1)}) <= 4 + -(-max_rows // 16)


def _fill(kv: KVSlots, like: torch.Tensor, prompts: list[int], steps: int, gen: torch.Generator) -> None:
    """Rows with `prompts` real tokens, then `steps` decode steps; every written K/V value random."""
    kv.begin_step(prompts, like, n_layers=2)
    n = len(prompts)
    for layer in kv.layers:
        for buf in (layer.kbuf, layer.vbuf):
            buf[:n] = torch.where(kv.mask[:n, None, :, None], torch.randn(buf[:n].shape, generator=gen), 0.0)
    kv.end_step(n)
    _steps(kv, like, steps, gen)


def _rows(kv: KVSlots) -> list[list[torch.Tensor]]:
    """Each running row's real K/V, in order."""
    out = []
    for r in range(kv.rows):
        cols = kv.mask[r, : kv.length].nonzero().squeeze(1)
        out.append([buf[r][:, cols] for layer in kv.layers for buf in (layer.kbuf, layer.vbuf)])
    return out


def _steps(kv: KVSlots, like: torch.Tensor, steps: int, gen: torch.Generator) -> None:
    for _ in range(steps):
        col, _ = kv.begin_step([], like, n_layers=2)
        for layer in kv.layers:
            for buf in (layer.kbuf, layer.vbuf):
                buf[: kv.rows, :, col] = torch.randn(buf[: kv.rows, :, col].shape, generator=gen)
        kv.end_step(0)


@torch.inference_mode()
def test_a_rebuild_inside_fixed_buffers_keeps_every_row_and_the_buffers():
    """The same rows and steps in a slab with fixed buffers and in one that makes new buffers: the same
    real K/V per row after a rebuild for room and a trim; the fixed slab's buffers never moved."""
    like = torch.zeros((1, 2, 1, 4))
    fixed, moving = KVSlots(slots=4, fixed_buffers=True, min_capacity=WIDTH_STEP), KVSlots(slots=4)
    for kv in (fixed, moving):
        _fill(kv, like, [60, 10], steps=5, gen=torch.Generator().manual_seed(0))
    ptr = fixed.layers[0].kbuf.data_ptr()
    assert fixed.capacity == WIDTH_STEP
    for kv in (fixed, moving):
        gen = torch.Generator().manual_seed(1)
        kv.remove(0)  # the 60-token row leaves: 50 dead columns, too few to trim
        _steps(kv, like, WIDTH_STEP - 60, gen)  # past the fixed slab's capacity: a rebuild for room
        kv.begin_step([5], like, n_layers=2)  # a short row joins ...
        kv.end_step(1)
        _steps(kv, like, 3, gen)
        kv.remove(0)  # ... and the long one leaves: most columns are dead, a trim
        _steps(kv, like, 2, gen)
    assert fixed.rebuilds >= 2 and fixed.generation == 1 and fixed.layers[0].kbuf.data_ptr() == ptr
    assert fixed.real[: fixed.rows].tolist() == moving.real[: moving.rows].tolist() == [10]
    for a, b in zip(_rows(fixed), _rows(moving), strict=True):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@torch.inference_mode()
def test_a_fixed_slab_too_small_for_a_prompt_makes_bigger_buffers_and_says_so():
    like = torch.zeros((1, 2, 1, 4))
    kv = KVSlots(slots=2, fixed_buffers=True, min_capacity=64)
    kv.begin_step([10], like, n_layers=1)
    kv.end_step(1)
    assert (kv.generation, kv.capacity) == (1, 10 + 128)  # the prompt and 128 spare columns (> 64)
    col, _ = kv.begin_step([200], like, n_layers=1)  # longer than the buffers: new ones, twice as wide at least
    kv.end_step(1)
    assert kv.generation == 2 and kv.capacity >= 2 * 138 and col + 1 >= 200


def test_graphs_are_off_on_a_cpu_unless_asked_for_and_off_by_config(engine_model_dir):
    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()
    assert EngineCore(model).graphs is None  # a CPU: no capture, and the eager fused step is the faster one
    assert EngineCore(model, graphs=True).graphs is not None
    assert EngineCore(model, EngineConfig(cuda_graphs=False)).admit_rows == 1


async def test_with_graphs_waiting_requests_join_in_batches(engine_model_dir):
    """16 slots: a running row and 3 waiting ones join only once 2 rows are free (16 // 8)... which they
    are; with 15 rows running and 3 waiting, none joins until a second row ends."""
    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()
    core = EngineCore(model, EngineConfig(max_running_seqs=16), graphs=True)
    core.running = [GenRequest(rid=f"run{i}", input_ids=[1], max_new_tokens=4) for i in range(15)]
    core.waiting.extend(GenRequest(rid=f"w{i}", input_ids=[2, 3], max_new_tokens=4) for i in range(3))
    core.waiting.append(GenRequest(rid="probe", input_ids=[4], max_new_tokens=1))
    assert [r.rid for r in core._admit()] == ["probe"]  # a liveness probe never waits for the batch
    core.running.pop()
    assert [r.rid for r in core._admit()] == ["w0", "w1"]
