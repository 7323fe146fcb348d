"""What a weight sync in `trainer.weight_sync.mode=in_place` costs SGLang and not the embedded engine.

in_place is sent to SGLang as pause mode `retract` (weight_sync/sender.py PAUSE_MODE): SGLang frees every
running request's KV cache, puts it back in its waiting queue and, after continue, prefills its prompt
plus every token it already generated again, on the new weights (scheduler.py pause_generation,
schedule_batch.py reset_for_retract). The embedded engine keeps the running requests on their caches.
So each sync costs SGLang one re-prefill of the running batch's whole context; this measures it on the
embedded engine (a real server, the default model), in the same run as its baseline, decode steps:

  - reprefill: `--requests` requests of `--context` tokens each, sent together with max_new_tokens=1
    (each prefilled once, as SGLang re-prefills after a retract);
  - decode: the same requests with max_new_tokens=1+`--decode`; (decode - reprefill) / `--decode` is one
    decode step of that batch.
`reprefill_in_decode_steps` = reprefill / one decode step: how many tokens of every running request a
retract sync costs. Sides are interleaved over rounds (asyncrl/bench/rounds.py), medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, summary
from asyncrl.config import ModelConfig
from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.models import resolve_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=16, help="running requests at the sync (the default's "
                        "trainer.max_inflight_generations)")
    parser.add_argument("--context", type=int, default=384, help="tokens per request at the sync (prompt + output)")
    parser.add_argument("--decode", type=int, default=16, help="decode steps measured for the baseline")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--model-path", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--seed", type=int, default=0)


async def _timed(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    async with EngineClient(url, timeout_s=3600) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*[client.generate(p, SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                                     min_new_tokens=new_tokens)) for p in prompts])
        dt = time.perf_counter() - t0
    if any(len(r.output_ids) != new_tokens for r in out):
        raise RuntimeError(f"the engine did not produce {new_tokens} tokens per request")
    return dt


def run(args: argparse.Namespace) -> dict:
    for name in ("requests", "context", "decode", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"asyncrl bench retract: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model_dir = args.model_path or str(resolve_model_dir(ModelConfig()))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.context)] for _ in range(args.requests)]
    with launch_embedded(model_dir, max_running_seqs=args.requests,
                         max_running_tokens=args.requests * (args.context + args.decode + 8)) as engine:
        asyncio.run(_timed(engine.url, [prompts[0][:8]], 2))  # warm-up
        times = interleave({"reprefill": lambda: asyncio.run(_timed(engine.url, prompts, 1)),
                            "decode": lambda: asyncio.run(_timed(engine.url, prompts, 1 + args.decode))},
                           args.rounds)
    pre, dec = statistics.median(times["reprefill"]), statistics.median(times["decode"])
    step = max((dec - pre) / args.decode, 1e-9)
    return {"requests": args.requests, "context": args.context, "decode_steps": args.decode, "rounds": args.rounds,
            **summary("reprefill_s", times["reprefill"]), **summary("decode_s", times["decode"]),
            "decode_step_s": round(step, 4), "reprefill_in_decode_steps": round(pre / step, 1),
            "reprefill_tok_s": round(args.requests * args.context / pre, 1)}
