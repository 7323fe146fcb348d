"""CPU kernel choice for the engine's small-batch forwards.

A decode step multiplies a few rows (the running sequences, M <= max_running_seqs) by every weight
matrix. nn.Linear computes y = x @ W^T with M small and N (out features) large; on this CPU build's
BLAS (MKL sgemm, measured on the 2-core AMD EPYC machine kind) that shape runs far below the rate
the same GEMM reaches with the long dimension in M. `SmallBatchLinear` computes the same product
transposed, y = (W @ x^T)^T, for inputs of at most `max_rows` rows, and falls back to nn.Linear
otherwise. Measured (2 threads, fp32, ms per call, Linear / transposed), SmolLM2-135M's shapes:

    rows                      16             48             144
    lm_head 49152 x 576       22.4 / 15.3    34.9 / 24.6    71.1 / 52.8
    mlp up 1536 x 576         0.306 / 0.217  0.606 / 0.508  1.503 / 1.378
    q_proj 576 x 576          0.197 / 0.099  0.260 / 0.208  0.600 / 0.541

The result is the same product (each output element is the same dot product; only the BLAS blocking
differs, so values may differ in the last bits, as between any two batch shapes). Parameters are
untouched: the module keeps its weight and bias tensors, so state_dict names and in-place weight
updates (EngineCore.apply_weights) are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 256  # up to this many rows the transposed product was measured faster for every shape


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose forward computes (W @ x^T)^T for at most `max_rows` rows on CPU."""

    max_rows: int = SMALL_BATCH_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows == 0 or rows > self.max_rows or x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(self.weight, x.reshape(rows, x.shape[-1])).T.contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def use_small_batch_linears(model: nn.Module, max_rows: int = SMALL_BATCH_ROWS) -> int:
    """Switch every plain fp32 nn.Linear of a CPU model to SmallBatchLinear (same parameters, same module
    tree); returns how many. A model on another device, or in bf16, is left alone (0): bf16's kernels on
    this CPU run the plain product faster (SmolLM2-135M decode at 16 rows, 2 threads: 24.7 ms plain,
    32.6 ms transposed; 4 rows 19.0 / 29.3 ms)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            m.__class__ = SmallBatchLinear
            m.max_rows = max_rows
            n += 1
    return n
