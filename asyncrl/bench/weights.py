"""Weight sync of the default model (SmolLM2-135M, fp32) from the real learner to embedded engines
over gloo: seconds per full sync (probe, pause, begin, buckets, end, continue) against the ceiling measured in
the same run and the same group: one flat broadcast of the same number of bytes, nothing else.
ratio = ceiling_s / sync_s (1.0 = the sync costs no more than moving the bytes once).

--delta: delta syncs (asyncrl/weight_sync/delta.py) against full syncs, on engines serving bf16 (the default
run's engine dtype on a GPU and on a CPU with native bf16) while the learner keeps fp32 masters and takes a
real AdamW step at the default run's learning rate (algorithm.lr) between syncs: its own language-model loss
on --tokens random tokens, so every weight, the tied embedding's rows included, gets a gradient. Each
round, after the step, one sender syncs its engines by deltas and another syncs a second set of engines
whole; both timed. Reported: bytes per delta sync as a fraction of a full one, and ratio = full_s / delta_s.
Every sync reads one tensor back (trainer.weight_sync.verify_every=1), so a delta that drifted would fail."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from asyncrl.bench.rounds import ratio, summary
from asyncrl.config import Config
from asyncrl.models import resolve_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs (and as many ceiling broadcasts)")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--mode", choices=["in_place", "abort"], default="in_place")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--no-coalesce", action="store_true", help="one broadcast per tensor (as for SGLang)")
    parser.add_argument("--delta", action="store_true", help="delta syncs against full ones, bf16 engines (see above)")
    parser.add_argument("--tokens", type=int, default=256, help="--delta: tokens of each training step's batch")


async def _measure(args: argparse.Namespace, worker, urls: list[str]) -> dict:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.weight_sync import WeightSender
    from asyncrl.weight_sync.broadcast import GroupTransport

    transport = GroupTransport("gloo", timeout_s=300, coalesce=not args.no_coalesce)
    sender = WeightSender(transport, timeout_s=300, mode=args.mode)
    left_out = await sender.connect(urls)
    if left_out:
        raise RuntimeError(f"engines left out of the group: {left_out}")
    bucket_bytes = args.bucket_mb << 20
    total = sum(p.numel() for p in worker.model.parameters())
    sync_s, ceil_s, reports = [], [], []
    try:
        await transport.broadcast_flat(sender.http, 1 << 20)  # warm the group's connections
        for i in range(args.syncs):
            ceil_s.append(await transport.broadcast_flat(sender.http, total))
            t0 = time.perf_counter()
            rep = await sender.sync(worker.iter_full_params(bucket_bytes), version=i + 1)
            sync_s.append(time.perf_counter() - t0)
            if not rep.ok:
                raise RuntimeError(f"sync {i + 1} failed: {rep.engines_failed}")
            reports.append(rep)
    finally:
        await sender.close()
    s, c = statistics.median(sync_s), statistics.median(ceil_s)
    return {"sync_s": round(s, 3), "ceiling_s": round(c, 3), "ratio": round(c / s, 3),
            "sync_s_all": [round(x, 3) for x in sync_s], "ceiling_s_all": [round(x, 3) for x in ceil_s],
            "bytes": reports[-1].bytes, "buckets": reports[-1].buckets, "collectives": reports[-1].collectives,
            "GBps_sync": round(reports[-1].bytes / s / 1e9, 3)}


async def _measure_delta(args: argparse.Namespace, worker, delta_urls: list[str], full_urls: list[str]) -> dict:
    # lazy: imports torch, which this module does not load otherwise
    import torch

    # lazy: the sender and its transport import torch
    from asyncrl.weight_sync import WeightSender
    from asyncrl.weight_sync.broadcast import GroupTransport  # lazy: as above

    def sender(delta: str) -> WeightSender:
        return WeightSender(GroupTransport("gloo", timeout_s=300, delta=delta), timeout_s=300, mode=args.mode)

    delta, full = sender("on"), sender("off")
    for s, urls in ((delta, delta_urls), (full, full_urls)):
        left_out = await s.connect(urls)
        if left_out:
            raise RuntimeError(f"engines left out of the group: {left_out}")
    opt = torch.optim.AdamW(worker.model.parameters(), lr=worker.cfg.algorithm.lr)
    gen = torch.Generator().manual_seed(0)
    vocab = worker.model.get_input_embeddings().weight.shape[0]
    bucket_bytes = args.bucket_mb << 20
    rows: list[dict] = []
    try:
        for version in range(1, args.syncs + 2):  # the first sync of each sender is full: not counted
            if version > 1:
                ids = torch.randint(0, vocab, (2, max(args.tokens // 2, 2)), generator=gen)
                opt.zero_grad()
                worker.model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
            row = {}
            for name, s in (("delta", delta), ("full", full)):
                rep = await s.sync(worker.iter_full_params(bucket_bytes), version=version)
                if not rep.ok:
                    raise RuntimeError(f"{name} sync {version} failed: {rep.engines_failed}")
                row[name] = rep
            rows.append(row)
    finally:
        await delta.close()
        await full.close()
    timed = rows[1:]
    if not all(r["delta"].delta for r in timed):
        raise RuntimeError("a sync after the first was not a delta: the engines lost the sender's base")
    fractions = [r["delta"].bytes / r["delta"].full_bytes for r in timed]
    d_s, f_s = [r["delta"].seconds for r in timed], [r["full"].seconds for r in timed]
    return {"lr": worker.cfg.algorithm.lr, "tokens_per_step": 2 * max(args.tokens // 2, 2),
            "full_bytes": timed[0]["full"].bytes, **summary("bytes_fraction", fractions, 4),
            **summary("delta_s", d_s, 3), **summary("full_s", f_s, 3), "ratio": ratio(f_s, d_s)}


def run(args: argparse.Namespace) -> dict:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.engine.launcher import launch_embedded
    from asyncrl.learner.worker import LearnerWorker

    cfg = Config()
    model_dir = resolve_model_dir(cfg.model)
    n = args.engines * (2 if args.delta else 1)
    dtype = {"dtype": "bfloat16"} if args.delta else {}
    with ThreadPoolExecutor(n) as ex:
        procs = list(ex.map(lambda _: launch_embedded(model_dir, threads=args.engine_threads, **dtype), range(n)))
    try:
        worker = LearnerWorker(cfg, rank=0, world_size=1)
        urls = [p.url for p in procs]
        if args.delta:
            out = asyncio.run(_measure_delta(args, worker, urls[:args.engines], urls[args.engines:]))
        else:
            out = asyncio.run(_measure(args, worker, urls))
    finally:
        for p in procs:
            p.stop()
    if args.delta:
        setup = {"model": "SmolLM2-135M, fp32 learner, bf16 engines",
                 "baseline": "full syncs of the same weights to as many engines, interleaved"}
    else:
        setup = {"model": "SmolLM2-135M fp32", "coalesce": not args.no_coalesce,
                 "baseline": "one flat broadcast, same bytes, same group"}
    return {"model": setup.pop("model"), "engines": args.engines, "transport": "gloo", **setup,
            "bucket_mb": args.bucket_mb, **out}
