"""The policy's token scores (logprob and entropy, asyncrl/learner/logprobs.py) at a micro-batch's kept
positions, with the output head run a chunk of tokens at a time.

Why: a micro-batch of K kept tokens over a vocabulary of V holds K x V logits, and their float32 copy,
log-softmax, softmax and gradients: about 6 x 4 x K x V bytes (for SmolLM2's V = 49,152 and K = 4,096,
about 4.8 GB), an order of magnitude more than the 135M model itself. Here the head (lm_head) and the
log-softmax run on `chunk` tokens at a time, each chunk under activation checkpointing: only its two
scores per token are kept, and the backward pass recomputes one chunk's logits at a time. The learner's
peak then holds one chunk's logits, whatever the micro-batch's size; the cost is one more head forward
per trained token (the head is about a fifth of SmolLM2-135M's forward FLOPs).

How: while the model's forward runs, its output-embedding module's `forward` is replaced by one that
maps the hidden states [K, H] (transformers' boolean `logits_to_keep` hands the head exactly the kept
positions, in row-major order) to the scores [K, 2] (or [K, 1] without entropy), which the model returns
as its `logits`. The head is called inside the model's own forward, so FSDP2 has its parameters gathered
as for the plain head. A model whose forward transforms the head's output (a final soft-cap, a logit
scale) would be scored wrongly: `ChunkedHead.check` compares the two ways on a few tokens once per model
and falls back to whole logits, with a warning, where they differ.

`chunk = 0` (algorithm.logits_chunk_tokens=0) scores the whole micro-batch at once, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from asyncrl.learner.logprobs import logprobs_and_entropy
from asyncrl.learner.packing import MicroBatch, kept_logits, supports_2d_logits_to_keep

log = logging.getLogger("asyncrl")

CHECK_ATOL = 1e-3  # the two ways agree to rounding (the head's GEMM blocks rows differently); a soft-cap is far off


def chunk_scores(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                 temperature: float, with_entropy: bool, chunk: int) -> torch.Tensor:
    """Scores [K, 2] (logprob, entropy) or [K, 1] of hidden states [..., H] (K rows once flattened) under
    the head `project`, `chunk` rows at a time; with autograd on, each chunk is checkpointed."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.shape[0] != targets.numel():
        raise ValueError(f"the head got {h.shape[0]} positions for {targets.numel()} targets")

    def one(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        logp, ent = logprobs_and_entropy(project(hc), tc, temperature, with_entropy)
        return torch.stack([logp, ent], -1) if ent is not None else logp[:, None]

    grad = torch.is_grad_enabled()
    parts = []
    for s in range(0, max(h.shape[0], 1), chunk):
        hc, tc = h[s:s + chunk], targets[s:s + chunk]
        parts.append(checkpoint(one, hc, tc, use_reentrant=False) if grad else one(hc, tc))
    return torch.cat(parts)


@contextmanager
def head_returns_scores(model: torch.nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool,
                        chunk: int) -> Iterator[None]:
    """For the block, `model(...)`'s logits are `chunk_scores` of the positions its head is given."""
    head = model.get_output_embeddings()
    own = head.__dict__.get("forward")  # an instance-level forward someone else set: put back afterwards
    project = head.forward
    head.forward = lambda hidden: chunk_scores(project, hidden, targets, temperature, with_entropy, chunk)
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


class ChunkedHead:
    """Scores a micro-batch with the head in chunks of `chunk` tokens (module docstring), or whole when
    `chunk` is 0, transformers cannot hand the head only the kept positions, or `check` found the model's
    forward changes the head's output."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self._verdicts: dict[int, bool] = {}

    def scores(self, model: torch.nn.Module, mb: MicroBatch, device: Any, temperature: float,
               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprob [K], entropy [K] or None), float32, at mb's kept positions (row-major order)."""
        targets = mb.targets.to(device)
        if not self.usable(model):
            return logprobs_and_entropy(kept_logits(model, mb, device), targets, temperature, with_entropy)
        with head_returns_scores(model, targets, temperature, with_entropy, self.chunk):
            s = kept_logits(model, mb, device)
        return s[:, 0], (s[:, 1] if with_entropy else None)

    def _enabled(self) -> bool:
        return self.chunk > 0 and supports_2d_logits_to_keep()

    def usable(self, model: torch.nn.Module) -> bool:
        return self._enabled() and self._verdicts.get(id(model), True)

    def check(self, model: torch.nn.Module, device: Any, pad_id: int) -> bool:
        """Score 8 tokens both ways (no grad) and remember whether they agree; False: whole logits for this
        model from now on. Run before the model is sharded: a local forward on each rank (a forward of an
        FSDP2 root outside training leaves its parameters unsharded, and the optimizer would hold those)."""
        if not self._enabled():
            return False
        n = 8
        ids = (torch.arange(n, device=device) * 7 + 3 + pad_id) % _vocab(model)
        kw = dict(input_ids=ids[None], position_ids=torch.arange(n, device=device)[None], use_cache=False,
                  logits_to_keep=torch.ones((1, n), dtype=torch.bool, device=device))
        targets = ids.roll(-1)
        with torch.no_grad():
            whole = logprobs_and_entropy(model(**kw).logits.reshape(n, -1), targets, 1.0)
            with head_returns_scores(model, targets, 1.0, True, max(1, n // 3)):
                s = model(**kw).logits.reshape(n, 2)
        ok = bool(torch.allclose(s[:, 0].float(), whole[0].float(), atol=CHECK_ATOL)
                  and torch.allclose(s[:, 1].float(), whole[1].float(), atol=CHECK_ATOL))
        if not ok:
            log.warning("learner: %s changes its head's output in its forward (a soft-cap or a scale): it is "
                        "scored with whole logits (algorithm.logits_chunk_tokens has no effect on it)",
                        type(model).__name__)
        self._verdicts[id(model)] = ok
        return ok


def _vocab(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
