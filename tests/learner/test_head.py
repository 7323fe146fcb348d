"""The chunked output head (asyncrl/learner/head.py) on the real tiny model (SmolLM2's 49,152-token vocabulary):
the same scores and gradients as whole logits, a model that changes its head's output is found and scored
whole. That the learner's step then holds one chunk's logits rather than the micro-batch's is measured in a
fresh process by tests/core/test_bench_memory.py."""

from __future__ import annotations

import logging

import torch

from asyncrl.config import ModelConfig
from asyncrl.learner.head import ChunkedHead
from asyncrl.learner.logprobs import logprobs_and_entropy
from asyncrl.learner.packing import build_micro_batch, kept_logits, specs_of
from asyncrl.models import load_model
from tests.learner.helpers import make_batch


def _model(model_dir):
    torch.manual_seed(0)
    return load_model(ModelConfig(path=str(model_dir)), device="cpu", dtype="float32")


def _micro_batch():
    specs, _ = specs_of(make_batch(seed=4, groups=2, per_group=3, shared_prompt=True).trajectories())
    return build_micro_batch(specs, list(range(len(specs))), True, 0, share_prompts=True)


def _scores_and_grads(model, head: ChunkedHead, mb, weights):
    model.zero_grad(set_to_none=True)
    logp, ent = head.scores(model, mb, "cpu", 0.7)
    ((logp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_chunked_scores_and_their_gradients_equal_the_whole_logits(tiny_model_dir):
    model, mb = _model(tiny_model_dir), _micro_batch()
    k = int(mb.keep.sum())
    weights = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    whole = _scores_and_grads(model, ChunkedHead(0), mb, weights)
    assert not ChunkedHead(0).usable(model)
    for chunk in (1, 5, k + 100):  # one token a chunk, a ragged last chunk, one chunk for all
        head = ChunkedHead(chunk)
        assert head.check(model, "cpu", 0) and head.usable(model)
        logp, ent, grads = _scores_and_grads(model, head, mb, weights)
        assert torch.allclose(logp, whole[0], atol=1e-5) and torch.allclose(ent, whole[1], atol=1e-5), chunk
        for n, g in grads.items():  # summed in another order (per chunk): equal to rounding
            assert (g - whole[2][n]).norm() <= 1e-5 * whole[2][n].norm(), (chunk, n)
    with torch.no_grad():  # scoring without autograd (the proximal and reference forwards) chunks too
        logp, ent = ChunkedHead(3).scores(model, mb, "cpu", 0.7, with_entropy=False)
    assert ent is None and torch.allclose(logp, whole[0], atol=1e-5)
    assert model.get_output_embeddings().forward.__func__ is torch.nn.Linear.forward  # the head is itself again


class HalvedLogits(torch.nn.Module):
    """A model whose forward scales its head's output, as a final soft-cap or logit scale does."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = out.logits * 0.5
        return out


def test_a_model_that_changes_its_heads_output_is_scored_with_whole_logits(tiny_model_dir, caplog):
    model, mb = HalvedLogits(_model(tiny_model_dir)), _micro_batch()
    head = ChunkedHead(4)
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        assert not head.check(model, "cpu", 0)
    assert "HalvedLogits changes its head's output" in caplog.text and not head.usable(model)
    with torch.no_grad():
        logp, ent = head.scores(model, mb, "cpu", 0.7)
        want = logprobs_and_entropy(kept_logits(model, mb), mb.targets, 0.7)
    assert torch.equal(logp, want[0]) and torch.equal(ent, want[1])
