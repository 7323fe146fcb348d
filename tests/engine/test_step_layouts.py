"""EngineCore in process, both step layouts (engine/fused.py's one forward per step, and a forward per
prompt then the batched decode), on a workload built to exercise every KV-slot path: rows joining a
running batch with shorter and longer prompts than its width (a rebuild), rows leaving from the
middle (the last row moves into the hole), requests sharing a prompt (one prefill), a one-token
probe (no row), more requests than slots (waiting), a context-limit finish. Every output must be
transformers' own greedy continuation and every logprob its teacher-forced one."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import EngineConfig
from asyncrl.engine.protocol import BadRequest, GenRequest
from asyncrl.engine.scheduler import EngineCore
from tests.engine.conftest import greedy_reference, teacher_forced_logprobs

# (prompt, max_new_tokens): the first three share a prompt and are admitted together (all are queued
# before the loop's first step); the 150-token prompt joins while shorter rows run
WORK = [
    ([11, 12, 13, 14], 9), ([11, 12, 13, 14], 9), ([11, 12, 13, 14], 9), ([5, 6, 7], 24),
    (list(range(100, 140)), 6), ([9] * 7, 30), (list(range(300, 311)), 3), (list(range(500, 650)), 12),
    (list(range(700, 705)), 1), ([42], 17), (list(range(900, 960)), 5),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per_prompt"])
async def test_both_layouts_give_transformers_greedy_tokens_and_teacher_forced_logprobs(
        engine_model_dir, tiny_model, fused):
    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()  # the core's own copy
    core = EngineCore(model, EngineConfig(max_running_seqs=4), prefill_tokens_per_step=200, fused=fused)
    assert core.fused is fused
    core.start()
    try:
        reqs = [GenRequest(rid=f"r{i}", input_ids=p, temperature=0.0, max_new_tokens=n, min_new_tokens=n,
                           return_logprob=True) for i, (p, n) in enumerate(WORK)]
        replies = await asyncio.wait_for(asyncio.gather(*(core.generate(r) for r in reqs)), 240)
    finally:
        await core.close()
    for (prompt, n), req, reply in zip(WORK, reqs, replies):
        assert req.output_ids == greedy_reference(tiny_model, prompt, n), (prompt[:3], n)
        ref = teacher_forced_logprobs(tiny_model, prompt, req.output_ids, 0.0)
        assert max(abs(a - b) for a, b in zip(req.logprobs, ref)) < 1e-4
        assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert core.prefills == len(WORK) - 2  # the three requests with one prompt, admitted together, prefill once
    assert core.kv.rebuilds >= 1 and core.kv.rows == 0 and not core.running and not core.live


@pytest.mark.timeout(120)
async def test_a_row_stops_at_the_model_context_in_the_fused_layout(engine_model_dir):
    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()
    core = EngineCore(model, EngineConfig(max_running_seqs=2), fused=True)
    ctx = core.max_context
    core.start()
    try:
        # input_ids plus max_new_tokens at the context exactly (one more is refused, as SGLang refuses it)
        long = GenRequest(rid="long", input_ids=list(range(1, ctx - 3)), temperature=0.0, max_new_tokens=4)
        with pytest.raises(BadRequest, match="exceeds the model's maximum context length"):
            await core.generate(GenRequest(rid="past", input_ids=list(range(1, ctx - 3)), max_new_tokens=5))
        short = GenRequest(rid="short", input_ids=[1, 2, 3], temperature=0.0, max_new_tokens=8, min_new_tokens=8)
        a, b = await asyncio.wait_for(asyncio.gather(core.generate(long), core.generate(short)), 100)
    finally:
        await core.close()
    assert a["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert len(long.input_ids) + len(long.output_ids) <= ctx
    assert len(short.output_ids) == 8


def test_slot_attention_outside_an_engine_step_is_refused():
    from asyncrl.engine.fused import slot_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="only inside an engine step"):
        slot_attention(torch.nn.Module(), q, q, q, None)


def test_a_full_slab_with_dead_columns_still_fits_a_long_joining_prompt():
    """Found on a GPU run (128 running rows, multi-turn prompts of ~360 tokens): a step that found the slab
    full rebuilt it for room alone, trimming the dead columns on the left, and left fewer columns before the
    step's end than a joining prompt needed ("expanded size of the tensor (0) must match ... (362)").
    Built here directly: row A (200 tokens) and row B (100) run until the slab is full, A leaves (too few
    dead columns to trim), and a 300-token prompt joins: it fits, right-aligned at the step's end."""
    from asyncrl.engine.kvbatch import KVSlots

    like = torch.zeros((1, 2, 1, 4))
    kv = KVSlots(slots=4)
    col, _ = kv.begin_step([200], like, n_layers=1)
    kv.end_step(1)
    col, _ = kv.begin_step([100], like, n_layers=1)
    kv.end_step(1)
    while kv.length < kv.capacity:
        kv.begin_step([], like, n_layers=1)
        kv.end_step(0)
    kv.remove(0)  # B moves into row 0; its dead columns on the left stay (fewer than half the length)
    assert kv.rows == 1 and kv.length == kv.capacity and kv.length - int(kv.real[0]) == 101
    col, mask = kv.begin_step([300], like, n_layers=1)
    assert col + 1 >= 300
    assert int(kv.mask[1].sum()) == 300 and bool(kv.mask[1, col + 1 - 300 : col + 1].all())
    assert int(kv.mask[0].sum()) == int(kv.real[0]) + 1 and bool(kv.mask[0, col])  # B: its tokens and this step's
    kv.end_step(1)
    assert kv.rows == 2 and kv.real[:2].tolist() == [228, 300]
