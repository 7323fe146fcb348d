"""Decode steps replayed as CUDA graphs: one launch per step instead of about two thousand.

Why: on a GPU the embedded engine was host-bound. A decode step of SmolLM2-135M is ~2,100 small PyTorch
ops (about 70 per layer, 30 layers, plus sampling), each tens of microseconds of host time on the lent
machines, so a step took ~40-60 ms whatever the rows: 81 tokens/s at 16 rows and 312 at 128 on an H200
(docs/benchmarks.md, "The second GPU run"). Captured once, a step replays with one launch.

What is captured: a pure decode step (every running row draws one token, no prompt joins) of `rows`
rows attending over the KV slab's first `width` columns, by `decode_forward`: the model's embedding, its
decoder layers (each calling `slot_attention` with a StepPlan whose column is a tensor), its final norm
and lm_head, a loop over the model's own modules rather than its forward (which builds masks and
checks shapes in Python on every call). Inputs are static tensors the step fills before a replay: the
rows' last tokens, their positions, the column; the mask is the KV slab's own (`kv.mask`), read in place.
- rows are bucketed (1, 2, 4, 8, then multiples of 16 up to max_running_seqs); the rows past the
  running ones decode token 0 at position 0 and attend their whole row of the slab (finite K/V or
  zeros), so what they write is finite; their logits are dropped;
- widths are multiples of `WIDTH_STEP` columns, at most the slab's capacity; columns past the step's
  column are masked;
- the slab runs with fixed buffers (kvbatch.py: rebuilds move columns inside the same buffers), and a
  rebuild that must make bigger ones bumps `kv.generation`, which drops every graph of the old ones.
Graphs are captured when a (rows, width) pair is first needed, into one memory pool; sampling, the
logprobs and the bookkeeping stay eager (engine/scheduler.py `_emit`). Steps where prompts join run the
eager fused step as before, and the scheduler admits waiting requests in batches while graphs are on
(`EngineCore._admit`), so most steps are pure decode steps.

`capture=False` runs the same function on the same static tensors without capturing (any device):
the tests check on a CPU that it draws what the eager step draws (tests/engine/test_graphs.py); the
capture itself runs in tests/engine/test_gpu.py.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.engine.fused import StepPlan, supports_fused
from asyncrl.engine.kvbatch import KVSlots

WIDTH_STEP = 256  # attention widths are multiples of this many KV columns
MIN_COLUMNS = 1024  # the slab's first buffers when graphs are on (they grow by doubling)


def supports_graphs(model: Any) -> bool:
    """`decode_forward` can run the model: a fused-attention model with the usual decoder layout."""
    inner = getattr(model, "model", None)
    return (supports_fused(model) and getattr(model, "lm_head", None) is not None
            and all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")))


def decode_forward(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """input_ids, position_ids [1, n] -> logits [n, V]: the model's modules, in its forward's order."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    embeddings = inner.rotary_emb(hidden, position_ids)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=embeddings,
                       asyncrl_plan=plan)
        if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
            hidden = hidden[0]
    return model.lm_head(inner.norm(hidden)[0])


def row_bucket(n: int, max_rows: int) -> int:
    """The captured row count that serves `n` running rows."""
    for b in (1, 2, 4, 8):
        if n <= b:
            return min(b, max_rows)
    return min(-(-n // 16) * 16, max_rows)


class DecodeGraphs:
    """The captured decode steps of one engine (see the module docstring)."""

    def __init__(self, model: Any, kv: KVSlots, max_rows: int, *, capture: bool):
        if not kv.fixed_buffers:
            raise ValueError("DecodeGraphs needs a KV slab with fixed buffers (KVSlots(fixed_buffers=True))")
        self.model, self.kv, self.max_rows, self.capture = model, kv, max_rows, capture
        device = next(model.parameters()).device
        self.ids = torch.zeros((1, max_rows), dtype=torch.long, device=device)
        self.pos = torch.zeros((1, max_rows), dtype=torch.long, device=device)
        self.column = torch.zeros((1,), dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.generation = -1
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0
        self.replays = 0  # steps served by a graph (without capture: by its function)
        self.shapes: set[tuple[int, int]] = set()  # (rows, width) pairs served

    def width(self, column: int) -> int:
        return min(-(-(column + 1) // WIDTH_STEP) * WIDTH_STEP, self.kv.capacity)

    def step(self, tokens: list[int], column: int) -> torch.Tensor:
        """Logits [n, V] of the running rows, whose last tokens are `tokens`, writing KV column `column`
        (KVSlots.begin_step made room for it and marked it; end_step follows)."""
        kv, n = self.kv, len(tokens)
        rows, width = row_bucket(n, self.max_rows), self.width(column)
        if kv.generation != self.generation:  # new buffers: the graphs read the old ones
            self.graphs.clear()
            self.generation = kv.generation
        self.ids[0, :n] = torch.tensor(tokens, dtype=torch.long)
        self.ids[0, n:rows] = 0
        self.pos[0, :n] = kv.real[:n]
        self.pos[0, n:rows] = 0
        self.column.fill_(column)
        kv.mask[n:rows, :width] = True  # the padding rows attend their own (finite) columns
        self.shapes.add((rows, width))
        self.replays += 1
        if not self.capture:
            return self._forward(rows, width)[:n]
        entry = self.graphs.get((rows, width))
        if entry is None:
            entry = self.graphs[(rows, width)] = self._capture(rows, width)
        graph, logits = entry
        graph.replay()
        return logits[:n]

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        mask = self.kv.mask[:rows, :width][:, None, None, :]
        plan = StepPlan(self.kv, rows, 0, mask, [], column_index=self.column, width=width)
        return decode_forward(self.model, self.ids[:, :rows], self.pos[:, :rows], plan)

    def _capture(self, rows: int, width: int) -> tuple[Any, torch.Tensor]:
        # a warm-up on a side stream first, as torch.cuda.graph asks (it computes this very step: the K/V
        # it writes are the ones the replay writes again)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(rows, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(rows, width)
        self.captures += 1
        return graph, logits
