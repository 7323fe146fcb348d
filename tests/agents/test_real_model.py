"""Token accounting against real model forwards and the real tokenizer.

1. `HFGreedyStandIn`: a STAND-IN Generator written for this test (transformers greedy `generate`
   on the tiny model, logprobs from a separate forward pass), not the project's engine.
2. The real embedded engine server (asyncrl.engine.launcher.launch_embedded + EngineClient).

Both run tool_agent with the answer_feedback interaction (two assistant turns around a masked
feedback user turn) and single_turn, then check, independently of the loop: the response ids are
exactly generated ids + the hand-written ChatML delta; every generated token is the argmax of a
fresh forward pass over prompt + response (so each turn conditioned on exactly the trajectory's
ids), and its behavior logprob equals log_softmax of that forward.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.agents.base import run_episode
from asyncrl.config import SamplingConfig
from asyncrl.engine import launcher
from asyncrl.engine.base import GenerateResult, SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.envs.interactions import extract_answer

from .helpers import enc, make_ctx, make_sample

FEEDBACK = 'Your answer {} is incorrect. Check your work and try again. End with a line "Answer: N".'


class HFGreedyStandIn:
    """STAND-IN for the engine (test only): greedy transformers generate + forward-pass logprobs."""

    def __init__(self, model, tokenizer):
        self.model, self.tok = model, tokenizer
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.suppress = [i for i in tokenizer.all_special_ids if i != im_end]

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: Optional[str] = None,
                       session_id: Optional[str] = None) -> GenerateResult:
        x = torch.tensor([input_ids])
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=sampling.max_new_tokens, eos_token_id=sampling.stop_token_ids,
                                      pad_token_id=sampling.stop_token_ids[0], suppress_tokens=self.suppress)
            new = out[0, len(input_ids):].tolist()
            logits = self.model(out).logits[0, len(input_ids) - 1: -1].float()
            lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None])[:, 0].tolist()
        stopped = bool(new) and new[-1] in sampling.stop_token_ids
        return GenerateResult(output_ids=new, logprobs=lps, versions=[0] * len(new),
                              finish_reason="stop" if stopped else "length", weight_version=0, engine="stand-in")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def check_against_forward(model, traj, atol: float = 1e-4) -> None:
    """Every generated token is the greedy choice of a forward over the final ids, with that logprob."""
    prompt, resp = traj.prompt_ids.numpy().tolist(), traj.response_ids.numpy().tolist()
    mask = traj.loss_mask.numpy().astype(bool)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1: -1].float()
    lp = torch.log_softmax(logits, -1)
    gen_pos = [i for i in range(len(resp)) if mask[i]]
    assert gen_pos, "no generated tokens"
    chosen = torch.tensor([resp[i] for i in gen_pos])
    expected = lp[gen_pos].gather(-1, chosen[:, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(traj.behavior_logprobs.numpy()[mask]), expected, atol=atol, rtol=0)
    # greedy: each generated token is the argmax (ties aside: compare logprob with the max)
    torch.testing.assert_close(expected, lp[gen_pos].max(-1).values, atol=atol, rtol=0)
    assert (traj.behavior_logprobs.numpy()[~mask] == 0).all() and (traj.versions.numpy()[~mask] == -1).all()


def split_turns(traj) -> list[list[int]]:
    """The generated runs (mask 1) of the response, in order."""
    resp, mask = traj.response_ids.numpy().tolist(), traj.loss_mask.numpy().tolist()
    runs, cur = [], []
    for t, m in zip(resp, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def expected_feedback_delta(tokenizer, g1: list[int], answer_text: str) -> list[int]:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closing = "\n" if g1[-1] == im_end else "<|im_end|>\n"
    shown = extract_answer(answer_text) or "(none found)"
    return enc(tokenizer, f"{closing}<|im_start|>user\n{FEEDBACK.format(shown)}<|im_end|>\n<|im_start|>assistant\n")


async def run_checks(engine, tokenizer, model, atol: float) -> None:
    ctx, _ = make_ctx(tokenizer, engine, max_turn_tokens=6, max_response_tokens=200, max_user_turns=1,
                           sampling=SamplingConfig(temperature=0.0))
    sample = make_sample(extra_info={"interaction_kwargs": {"name": "answer_feedback"}})
    traj = await run_episode(sample, ctx, "tool_agent")
    g = split_turns(traj)
    assert len(g) == 2 and traj.num_turns == 3 and len(traj.turn_rewards) == 2
    delta = expected_feedback_delta(tokenizer, g[0], traj.messages[2]["content"])
    assert traj.response_ids.numpy().tolist() == g[0] + delta + g[1]
    assert traj.loss_mask.numpy().tolist() == [1] * len(g[0]) + [0] * len(delta) + [1] * len(g[1])
    assert traj.messages[2]["content"] == tokenizer.decode(g[0], skip_special_tokens=True)
    check_against_forward(model, traj, atol)

    traj1 = await run_episode(make_sample(), ctx, "single_turn")
    assert traj1.loss_mask.numpy().tolist() == [1] * len(traj1.response_ids) and 1 <= len(traj1.response_ids) <= 6
    expected_prompt = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n" \
                      "<|im_start|>user\nWhat is 3*4+5?<|im_end|>\n<|im_start|>assistant\n"
    assert traj1.prompt_ids.numpy().tolist() == enc(tokenizer, expected_prompt)
    check_against_forward(model, traj1, atol)


@pytest.mark.timeout(120)
async def test_stand_in_model_token_accounting(tokenizer, model):
    await run_checks(HFGreedyStandIn(model, tokenizer), tokenizer, model, atol=1e-4)


@pytest.mark.timeout(240)
async def test_real_embedded_engine_token_accounting(tokenizer, model, tiny_model_dir):
    with launcher.launch_embedded(tiny_model_dir, threads=1, max_running_seqs=4, startup_timeout_s=180) as proc:
        client = EngineClient(proc.url, timeout_s=60)
        try:
            await run_checks(client, tokenizer, model, atol=1e-3)
        finally:
            await client.close()
