"""The learner step's peak memory against the model's own size, for the default run's and Search-R1's batch
shapes: whole logits (the baseline, algorithm.logits_chunk_tokens=0) against the chunked head (the default,
asyncrl/learner/head.py), and the chunked head with gradient checkpointing (model.gradient_checkpointing).

Each shape runs in a fresh process of its own (asyncrl/util/isolated.py): the default model's LearnerWorker
with the default config (bf16 autocast where the CPU has native bf16), a warm-up step (the optimizer's state
is allocated), then one `train_step` per side (the head's chunk and the model's checkpointing switched on the
same worker) on a GRPO-shaped batch: one group of `--samples` responses to one prompt
that starts with a system prefix (default shape: a 320-token prompt, responses of 40-400 tokens; Search-R1:
a 300-token prompt, responses of 200-512 tokens, what its multi-turn episodes with retrieved passages reach).
The batch fits one micro-batch (algorithm.micro_batch_tokens, 4096), so the step's peak is one micro-batch's.

Reported per shape and side: `growth_gb`, the step's peak resident memory above what was resident before it
(VmHWM after the step minus VmRSS before; the process's peak is reset first), `peak_gb` (the process's
peak in that step, the model, its gradients and optimizer state included) and `seconds`; `model_gb` (the
parameters' bytes); `<shape>_ratio_growth_whole_over_chunked` (> 1: chunking saves memory),
`<shape>_ratio_seconds_whole_over_chunked` (< 1: chunking costs time), and the same for gradient
checkpointing against chunking alone. glibc in each side's process maps blocks over 1 MiB on their own
(MALLOC_MMAP_THRESHOLD_), so resident memory follows what is live rather than what the heap kept.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from asyncrl.bench.learner import lengths_long_tailed, make_batch
from asyncrl.config import load_config
from asyncrl.learner.worker import LearnerWorker
from asyncrl.models import set_gradient_checkpointing
from asyncrl.util.isolated import call_isolated
from asyncrl.util.memory import peak_gb, reset_peak, rss_gb

SHAPES = {  # (prompt tokens, of them system prefix, shortest and longest response)
    "default": (320, 280, 40, 400),
    "search_r1": (300, 250, 200, 512),
}
SIDES = {"whole": (0, False), "chunked": (None, False), "chunked_gc": (None, True)}  # (chunk or default, gc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--samples", type=int, default=8, help="responses in the group (one micro-batch)")
    parser.add_argument("--model-path", default=None, help="a local HF directory instead of the default model")
    parser.add_argument("--seed", type=int, default=0)


def one_shape(model_path: str | None, shape: tuple[int, int, int, int], samples: int, seed: int) -> dict[str, Any]:
    """In a fresh process: the default config's learner, a warm-up step, then one measured step per side
    (module docstring) on the same worker (its head's chunk and its model's checkpointing switched)."""
    cfg = load_config([f"model.path={model_path}", "model=custom"] if model_path else [])
    w = LearnerWorker(cfg)
    vocab = int(w.model.config.vocab_size)
    prompt, system, lo, hi = shape
    w.train_step(make_batch([lo, lo], vocab, seed + 7, 2, prompt, system))  # warm-up: the optimizer's state
    batch = make_batch(lengths_long_tailed(samples, lo, hi, seed), vocab, seed, samples, prompt, system)
    out: dict[str, Any] = {"model_gb": round(sum(p.numel() * p.element_size() for p in w.model.parameters()) / 2**30, 3),
                           "cpu_bf16": w.cpu_bf16}
    for name, (chunk, gc) in SIDES.items():
        w.head.chunk = cfg.algorithm.logits_chunk_tokens if chunk is None else chunk
        set_gradient_checkpointing(w.model, gc)
        reset_peak()
        before = rss_gb()
        t0 = time.perf_counter()
        m = w.train_step(batch)
        seconds = time.perf_counter() - t0
        out[name] = {"growth_gb": round(peak_gb() - before, 3), "peak_gb": round(peak_gb(), 3),
                     "seconds": round(seconds, 2),
                     "logits_chunk_tokens": w.head.chunk if w.head.usable(w.model) else 0}
        out["tokens"], out["trained_tokens"] = int(m["learner/sequence_tokens"]), int(m["learner/tokens"])
    return out


def run(args: argparse.Namespace) -> dict:
    if args.samples < 1:
        raise SystemExit(f"asyncrl bench memory: --samples must be >= 1, got {args.samples}")
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by glibc as each side's process starts
    out: dict[str, Any] = {}
    try:
        for shape in shapes:
            got = call_isolated(one_shape, args.model_path, SHAPES[shape], args.samples, args.seed,
                                name=f"bench memory {shape}")
            out["model_gb"], out["cpu_bf16"] = got.pop("model_gb"), got.pop("cpu_bf16")
            out[shape] = got
            whole, c, g = got["whole"], got["chunked"], got["chunked_gc"]
            out[f"{shape}_ratio_growth_whole_over_chunked"] = round(whole["growth_gb"] / max(c["growth_gb"], 1e-3), 2)
            out[f"{shape}_ratio_seconds_whole_over_chunked"] = round(whole["seconds"] / max(c["seconds"], 1e-3), 3)
            out[f"{shape}_ratio_growth_chunked_over_gc"] = round(c["growth_gb"] / max(g["growth_gb"], 1e-3), 2)
            out[f"{shape}_ratio_seconds_chunked_over_gc"] = round(c["seconds"] / max(g["seconds"], 1e-3), 3)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return out
