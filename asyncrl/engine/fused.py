"""One forward per engine step: every running row's next token and every admitted prompt together.

A separate prefill forward per admitted prompt reads every weight once more than the decode step
already does; on a CPU, where a 16-row decode of SmolLM2-135M is bound by that read (~25 ms of its
~40), the prompts of a step ride in the decode forward instead (SGLang's mixed chunked prefill does
the same on GPU). The forward's input is one flat row:

    [d_0 .. d_{n-1}] [prompt_0 tokens] [prompt_1 tokens] ...

with d_r the last token of running row r (position = its real token count) and each prompt at
positions 0..p-1. The model's own modules compute projections, rotary embeddings and MLPs over all
T tokens at once; attention goes through `slot_attention`, registered with transformers'
AttentionInterface as "asyncrl_slots" (no attention mask is built for it), which per layer:
  - writes the decode tokens' K/V into column `column` of rows 0..n-1 of the KV slots and attends
    each with its row's cached columns (the slot mask), the query heads of one KV head packed as
    SGLang/transformers do for one-token queries;
  - attends each prompt causally over itself (the same sdpa call as a lone prefill), and writes the
    prompts' K/V into the rows the plan gives them (several, when requests share the prompt; none for
    a request that ends at its first token, e.g. a liveness probe), all prompts and rows by one
    indexed write per layer (`prompt_writes`: a GPU pays per op, not per byte, at these sizes).
The logits are kept only at the decode tokens and at each prompt's last token.

Models: those whose attention modules call transformers' attention interface with the rotated
query/key/value and a `layer_idx`, with plain causal attention over the whole context
(`supports_fused`: Llama, Qwen2/Qwen3 and Mistral families without a sliding window); any other model
runs the engine's per-prompt prefill and batched decode (EngineCore, `fused=False`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from asyncrl.engine.kvbatch import KVSlots

ATTENTION = "asyncrl_slots"
# on a GPU, every attention of a step but cuDNN's: torch 2.11 picked cuDNN's SDPA for the prompts' causal
# attention on an H200, which builds an execution plan per new sequence length on the host, ~5 ms a call:
# 95% of a step where 13 prompts joined (2.1 s of its 2.2 s; docs/benchmarks.md "CUDA graphs")
GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FUSED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass(slots=True)
class Segment:
    start: int  # the prompt's tokens in the flat row: [start, end)
    end: int
    rows: list[int] = field(default_factory=list)  # KV rows that take its K/V


@dataclass(slots=True)
class StepPlan:
    kv: KVSlots
    decode_rows: int  # rows 0..decode_rows-1 decode one token each
    column: int  # the KV column their tokens are written to
    decode_mask: torch.Tensor | None  # [n, 1, 1, column + 1] bool ([n, 1, 1, width] with column_index)
    segments: list[Segment]
    # where the prompts' K/V go, every segment and row at once (`prompt_writes`): one indexed write per layer
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # a decode step captured as a CUDA graph (engine/graphs.py): the column is a tensor [1] (its value
    # changes between replays, a captured kernel's arguments do not) and attention reads `width` columns
    column_index: torch.Tensor | None = None
    width: int = 0


def prompt_writes(segments: list[Segment], end_col: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, columns, tokens) [M] each: token `tokens[i]` of the flat row goes to KV row `rows[i]`, column
    `columns[i]`; each segment's p tokens right-aligned to `end_col` in every row it feeds (None: no row)."""
    rows, cols, src = [], [], []
    for seg in segments:
        p = seg.end - seg.start
        for r in seg.rows:
            rows.append(torch.full((p,), r, dtype=torch.long))
            cols.append(torch.arange(end_col - p, end_col))
            src.append(torch.arange(seg.start, seg.end))
    if not rows:
        return None
    return tuple(torch.cat(x).to(device) for x in (rows, cols, src))


def supports_fused(model: Any) -> bool:
    """The model's attention can run as `slot_attention` (see the module docstring)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FUSED_MODEL_TYPES:
        return False
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return False
    attn = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    return bool(attn) and all(isinstance(getattr(m, "layer_idx", None), int) for m in attn)


def use_slot_attention(model: Any) -> None:
    """Register `slot_attention` (once) and make `model` call it."""
    AttentionInterface.register(ATTENTION, slot_attention)
    model.set_attn_implementation(ATTENTION)


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                   asyncrl_plan: StepPlan | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] (rotated) -> ([1, T, H, D], None); see the module docstring."""
    plan = asyncrl_plan
    if plan is None:
        raise RuntimeError("slot_attention runs only inside an engine step (no asyncrl_plan was passed)")
    with sdpa_kernel(GPU_BACKENDS) if query.is_cuda else contextlib.nullcontext():
        return _slot_attention(module, query, key, value, scaling, plan)


def _slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float | None, plan: StepPlan) -> tuple[torch.Tensor, None]:
    layer = plan.kv.layers[module.layer_idx]
    _, h, t, d = query.shape
    hkv = key.shape[1]
    n, col = plan.decode_rows, plan.column
    if plan.column_index is not None:  # every row decodes (t == n); no Python value depends on the step
        kd = key[0].transpose(0, 1).unsqueeze(2)  # [n, Hkv, 1, D]
        layer.kbuf[:n].index_copy_(2, plan.column_index, kd)
        layer.vbuf[:n].index_copy_(2, plan.column_index, value[0].transpose(0, 1).unsqueeze(2))
        qd = query[0].transpose(0, 1).reshape(n, hkv, h // hkv, d)
        od = F.scaled_dot_product_attention(qd, layer.kbuf[:n, :, : plan.width], layer.vbuf[:n, :, : plan.width],
                                            attn_mask=plan.decode_mask, scale=scaling)
        return od.reshape(1, n, h, d), None
    out = query.new_empty((1, t, h, d))
    if n:
        kd = key[0, :, :n].transpose(0, 1)  # [n, Hkv, D]
        vd = value[0, :, :n].transpose(0, 1)
        layer.kbuf[:n, :, col] = kd
        layer.vbuf[:n, :, col] = vd
        qd = query[0, :, :n].transpose(0, 1).reshape(n, hkv, h // hkv, d)  # one KV head's query heads as rows
        od = F.scaled_dot_product_attention(qd, layer.kbuf[:n, :, : col + 1], layer.vbuf[:n, :, : col + 1],
                                            attn_mask=plan.decode_mask, scale=scaling)
        out[0, :n] = od.reshape(n, h, d)
    for seg in plan.segments:
        q, k, v = query[:, :, seg.start : seg.end], key[:, :, seg.start : seg.end], value[:, :, seg.start : seg.end]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=hkv != h)
        out[0, seg.start : seg.end] = o[0].transpose(0, 1)
    if plan.writes is not None:  # every prompt's K/V into every row it feeds (a group's samples share one)
        rows, cols, src = plan.writes
        layer.kbuf[rows, :, cols] = key[0][:, src].transpose(0, 1)
        layer.vbuf[rows, :, cols] = value[0][:, src].transpose(0, 1)
    return out, None
