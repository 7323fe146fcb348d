"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): `model.lora.rank > 0`.

Each targeted linear layer (by the last part of its module name: q_proj, v_proj, ...) becomes a `LoraLinear`:

    y = x W^T + b + s * (x A^T) B^T,    A in R^{r x in},  B in R^{out x r},  s = alpha / r

with W and b frozen (the pretrained weights, still named `<layer>.weight` / `.bias`), A initialised uniform in
+-1/sqrt(in) from a generator seeded by (model.lora.seed, layer index) so every rank builds the same A, and B
zero (the adapted model starts equal to the base). Only A and B train; FSDP2 shards them with the frozen rest.

Everything that leaves the learner is MERGED: W' = W + s * B A under the base layer's name, no lora_* tensors
(`merged_named_params` for weight syncs, `merge_state_dict` for exports and engine restarts), so engines and
`asyncrl export` see a plain model of the base architecture whose outputs are the adapted policy's.
Checkpoints keep A and B unmerged (to resume training).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


class LoraLinear(torch.nn.Linear):
    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        w = base.weight
        bound = 1.0 / math.sqrt(self.in_features)
        a = (torch.rand(rank, self.in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        self.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.scaling = float(alpha) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, targets: list[str], seed: int = 0) -> list[str]:
    """Replace every nn.Linear whose name ends in one of `targets` by a LoraLinear; freeze all else. Returns
    the replaced module names; none is a ValueError naming the model's linear layers."""
    if rank < 1:
        raise ValueError(f"model.lora.rank must be >= 1 to apply LoRA, got {rank}")
    linear = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    chosen = [(n, m) for n, m in linear if n.rsplit(".", 1)[-1] in targets]
    if not chosen:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})
        raise ValueError(f"model.lora.target_modules={targets} match no linear layer of {type(model).__name__}; "
                         f"its linear layers are named {names}")
    model.requires_grad_(False)
    for i, (name, module) in enumerate(chosen):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        setattr(parent, child, LoraLinear(module, rank, alpha, g))
    return [n for n, _ in chosen]


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def merged_named_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the model's parameters in named_parameters() order, with each LoRA layer's
    weight merged (W + s B A) and its lora_A / lora_B left out. Collective under FSDP2 (every rank walks the
    same order); only rank 0's tensors are meant to be used."""
    lora = {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in lora and leaf in ("lora_A", "lora_B"):
            continue
        if owner in lora and leaf == "weight":
            m = lora[owner]
            w, a, b = _full(m.weight), _full(m.lora_A), _full(m.lora_B)
            yield name, w + m.scaling * (b @ a)
        else:
            yield name, _full(p)


def merge_state_dict(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict with every `<layer>.lora_A/lora_B` pair merged into `<layer>.weight` and removed."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith(".lora_A")]:
        layer = key[: -len(".lora_A")]
        a, b = out.pop(key), out.pop(layer + ".lora_B")
        out[layer + ".weight"] = out[layer + ".weight"] + scaling * (b @ a)
    if any(k.endswith(".lora_B") for k in out):
        raise ValueError("a lora_B without its lora_A in the state dict")
    return out


def lora_scaling(cfg: Any) -> float:
    return float(cfg.alpha) / cfg.rank


def trainable_fraction(model: torch.nn.Module) -> float:
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad) / max(total, 1)
