"""Output tokens/s of the embedded engine vs transformers `generate` (left-padded static batches)
and transformers' own continuous batching (`generate_batch`'s manager), on one workload.

Workload (seeded): `--requests` prompts of 32..256 random tokens; long-tailed output lengths: one
request in `--long-every` wants `--max-new-tokens` tokens, the others 1/16..1/8 of that. Every
system generates exactly each request's length (EOS banned until the length is reached; greedy, or
sampled at `--temperature` with no top-k or top-p on every side), so all three produce the same useful
tokens; tokens/s = sum(lengths) / wall time.
  (a) embedded engine: a real server subprocess, all requests sent at once through EngineClient,
      max_running_seqs = --batch;
  (b) `model.generate` on static left-padded batches of --batch requests in arrival order (each
      batch runs until its longest request is done);
  (c) transformers' continuous batching manager, per-request max_new_tokens (skip with --skip-cb);
  (d) with --eager-engine: (a) with `engine.cuda_graphs=false`, a second server (on a GPU, (a) replays
      its decode steps as CUDA graphs, asyncrl/engine/graphs.py; (d) runs every step eagerly).
(a)'s server's own counters (steps, graph replays and captures) are reported as `engine_stats`.
The sides run interleaved (a, b, c, a, b, c, ...) for ``--rounds`` rounds (asyncrl/bench/rounds.py);
each is reported by its median tokens/s and seconds with their spread, and the ratios are ratios of
median times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.config import ModelConfig
from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.models import default_device, engine_dtype, resolve_model_dir, torch_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="length of the long requests")
    parser.add_argument("--long-every", type=int, default=8, help="one request in N is long")
    parser.add_argument("--batch", type=int, default=16, help="running sequences / static batch size")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-path", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--skip-cb", action="store_true", help="skip (c), transformers' continuous batching")
    parser.add_argument("--skip-static", action="store_true", help="skip (b), static-batch generate")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="every side's weights and compute (auto: what the engine serves on this machine)")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds; medians are reported")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="every side's device (auto: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--eager-engine", action="store_true",
                        help="also run (d) the engine with engine.cuda_graphs=false (on a GPU: every step eager)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; > 0: every side samples at this temperature (as RL's rollouts do)")


def workload(n: int, long_len: int, long_every: int, min_prompt: int, max_prompt: int, vocab: int,
             seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(min_prompt, max_prompt))]
        if i % long_every == long_every - 1:
            length = long_len
        else:
            length = rng.randint(max(1, long_len // 16), max(1, long_len // 8))
        out.append((prompt, length))
    return out


def _sampling(temperature: float) -> dict[str, Any]:
    """transformers' generate arguments for the workload's draw (its default top_k of 50 switched off)."""
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {"do_sample": False}


async def _engine_run(url: str, work: list[tuple[list[int], int]], temperature: float) -> float:
    async with EngineClient(url, timeout_s=3600) as client:
        await client.generate(work[0][0][:8], SamplingParams(temperature=0, max_new_tokens=2))  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            client.generate(p, SamplingParams(temperature=temperature, max_new_tokens=n, min_new_tokens=n)) for p, n in work
        ])
        dt = time.perf_counter() - t0
    got = [len(r.output_ids) for r in results]
    want = [n for _, n in work]
    if got != want:
        raise RuntimeError(f"engine produced lengths {got[:8]}..., expected {want[:8]}...")
    return dt


def _static_run(model: Any, work: list[tuple[list[int], int]], batch: int, pad_id: int, temperature: float) -> float:
    model.generate(torch.tensor([work[0][0][:8]], device=model.device), max_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    for s in range(0, len(work), batch):
        chunk = work[s : s + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(k for _, k in chunk)
        model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                       **_sampling(temperature))
    return time.perf_counter() - t0


def _cb_run(model: Any, work: list[tuple[list[int], int]], batch: int, temperature: float) -> float:
    # (c) only, which --skip-cb leaves out: this API has moved between transformers releases
    gen = GenerationConfig(max_new_tokens=max(n for _, n in work), eos_token_id=-1, **_sampling(temperature))
    # size its paged cache for `batch` running requests (left to itself it takes most of free RAM)
    page = 256
    blocks = batch * -(-max(len(p) + n for p, n in work) // page) + 4
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=2048,
                                  max_requests_per_batch=batch)
    mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    mgr.start()
    try:
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(work):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done = 0
        while done < len(work):
            r = mgr.get_result(timeout=600)
            if r is None:
                raise RuntimeError("transformers continuous batching returned no result within 600 s")
            if r.is_finished():
                done += 1
        return time.perf_counter() - t0
    finally:
        mgr.stop(block=True)


def run(args: argparse.Namespace) -> dict:
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise SystemExit(f"asyncrl bench engine: --temperature must be a finite number >= 0, got {args.temperature}")
    device = default_device() if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"asyncrl bench engine: --device cuda, but torch {torch.__version__} sees no CUDA GPU")
    model_dir = args.model_path or str(resolve_model_dir(ModelConfig()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = workload(args.requests, args.max_new_tokens, args.long_every, args.min_prompt, args.max_prompt,
                    len(tok), args.seed)
    tokens = sum(n for _, n in work)
    threads = torch.get_num_threads()
    dtype = engine_dtype(args.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def static() -> float:
        with torch.inference_mode():
            return _static_run(model, work, args.batch, pad, args.temperature)

    # the engine's server process lives through every round (idle while the other sides run)
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(launch_embedded(model_dir, max_running_seqs=args.batch, threads=threads,
                                                   dtype=dtype, device=device))
        sides = {"engine": lambda: asyncio.run(_engine_run(proc.url, work, args.temperature))}
        if args.eager_engine:
            eager = stack.enter_context(launch_embedded(model_dir, max_running_seqs=args.batch, threads=threads,
                                                        dtype=dtype, device=device, cuda_graphs=False))
            sides["engine_eager"] = lambda: asyncio.run(_engine_run(eager.url, work, args.temperature))
        if not args.skip_static:
            sides["static"] = static
        if not args.skip_cb:
            sides["hf_continuous"] = lambda: _cb_run(model, work, args.batch, args.temperature)
        seconds = interleave(sides, args.rounds)
        stats = httpx.get(proc.url + "/stats", timeout=30).json()
    out: dict[str, Any] = {
        "model": str(model_dir).rsplit("/", 1)[-1], "requests": len(work), "output_tokens": tokens,
        "batch": args.batch, "threads": threads, "rounds": args.rounds, "dtype": dtype,
        "temperature": args.temperature, "device": device,
    }
    out["engine_stats"] = {k: stats.get(k) for k in ("steps", "prefills", "graph_captures", "graph_replays")}
    names = {"engine": "engine", "engine_eager": "engine_eager", "static": "static_generate",
             "hf_continuous": "hf_continuous"}
    for side, values in seconds.items():
        out.update(summary(f"{names[side]}_tok_s", [tokens / v for v in values]))
        out.update(summary(f"{names[side]}_s", values))
    if "static" in seconds:
        out["a_over_b"] = ratio(seconds["static"], seconds["engine"])
    if "hf_continuous" in seconds:
        out["a_over_c"] = ratio(seconds["hf_continuous"], seconds["engine"])
    if "engine_eager" in seconds:
        out["a_over_d"] = ratio(seconds["engine_eager"], seconds["engine"])
    return out
