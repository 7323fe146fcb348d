"""GPU paths: the embedded engine on CUDA in bf16, and a real SGLang server through our client.

Both are marked `gpu` (skipped without CUDA); the SGLang test also needs the `sglang` package."""

from __future__ import annotations

import asyncio

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_embedded_engine_on_cuda_bf16(engine_model_dir):
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.protocol import parse_request
    from asyncrl.engine.scheduler import EngineCore

    def load():
        return AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.bfloat16).to("cuda").eval()

    engine_model, model = load(), load()  # the core's own copy (it switches its attention to KV slots), the reference
    prompts = [list(range(100, 130)), [5, 6, 7], list(range(2000, 2090))]

    graphs = {}

    async def run() -> list[dict]:
        core = EngineCore(engine_model)  # on a GPU: decode steps replay CUDA graphs (engine/graphs.py)
        graphs["core"] = core.graphs
        core.start()
        try:
            solo = []
            for p in prompts:  # one at a time: the same kernels as transformers' generate
                solo.append(await core.generate(parse_request(
                    {"input_ids": p, "return_logprob": True,
                     "sampling_params": {"temperature": 0, "max_new_tokens": 16, "min_new_tokens": 16}},
                    core.vocab_size)))
            together = await asyncio.gather(*[core.generate(parse_request(
                {"input_ids": p, "return_logprob": True, "sampling_params": {"temperature": 0.8, "sampling_seed": i,
                                                                              "max_new_tokens": 16}},
                core.vocab_size)) for i, p in enumerate(prompts)])
            return solo + list(together)
        finally:
            await core.close()

    outs = asyncio.run(run())
    assert graphs["core"] is not None and graphs["core"].captures > 0 and graphs["core"].replays > 16
    for p, o in zip(prompts, outs[:3]):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o["output_ids"] == ref
    for p, o, t in zip(prompts * 2, outs, [0.0] * 3 + [0.8] * 3):
        ids = torch.tensor([p + o["output_ids"]], device="cuda")
        with torch.inference_mode():
            logits = model(ids).logits[0, len(p) - 1 : -1].float()
        ref = torch.log_softmax(logits / (t or 1.0), -1).gather(-1, ids[0, len(p):, None])[:, 0].cpu()
        got = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
        assert (ref - got).abs().max().item() < 5e-2  # bf16 forwards: batched and full-sequence differ slightly


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_sglang_server_greedy_and_logprobs_via_client(engine_model_dir):
    pytest.importorskip("sglang", reason="the sglang package is not installed")
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.base import SamplingParams
    from asyncrl.engine.client import EngineClient
    from asyncrl.engine.launcher import launch_sglang

    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).to("cuda").eval()
    p = list(range(300, 340))
    with launch_sglang(engine_model_dir, dtype="float32", mem_fraction_static=0.2, weight_version=4,
                       extra_args=["--disable-cuda-graph"]) as proc:

        async def run():
            async with EngineClient(proc.url) as c:
                res = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=12))
                return res, await c.weight_versions()

        res, versions = asyncio.run(run())
    with torch.inference_mode():
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        logits = model(torch.tensor([p + res.output_ids], device="cuda")).logits[0, len(p) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(res.output_ids, device="cuda")[:, None])
    assert res.output_ids == ref and res.finish_reason == "length"
    assert max(abs(a - b) for a, b in zip(res.logprobs, lp[:, 0].tolist())) < 1e-2
    assert res.versions == [4] * 12 and versions == [4]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_step_where_prompts_join_never_runs_cudnn_attention(engine_model_dir):
    """On an H200 (torch 2.11) cuDNN's SDPA took 95% of a step where 13 prompts joined: it builds an execution
    plan per new sequence length on the host (~5 ms a call). The engine's steps keep to the other backends."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.protocol import GenRequest
    from asyncrl.engine.scheduler import EngineCore

    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.bfloat16).to("cuda").eval()
    core = EngineCore(model)
    running = [GenRequest(rid=f"run{i}", input_ids=list(range(10 + i, 50 + i)), max_new_tokens=8) for i in range(3)]
    joining = [[GenRequest(rid=f"new{i}", input_ids=list(range(100, 131 + 7 * i)), max_new_tokens=8)] for i in range(5)]
    core._step([[r] for r in running])  # three rows running
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        core._step(joining)  # they decode while five prompts of five lengths join
    names = {e.key for e in p.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)
    assert len(core.running) == 8
