"""Weight sync of the default model (SmolLM2-135M, fp32) from the real learner to embedded engines
over gloo: seconds per full sync (probe, pause, begin, buckets, end, continue) against the ceiling measured in
the same run and the same group: one flat broadcast of the same number of bytes, nothing else.
ratio = ceiling_s / sync_s (1.0 = the sync costs no more than moving the bytes once)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from asyncrl.config import Config
from asyncrl.models import resolve_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs (and as many ceiling broadcasts)")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--mode", choices=["in_place", "abort"], default="in_place")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--no-coalesce", action="store_true", help="one broadcast per tensor (as for SGLang)")


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


def run(args: argparse.Namespace) -> dict:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.engine.launcher import launch_embedded
    from asyncrl.learner.worker import LearnerWorker

    cfg = Config()
    model_dir = resolve_model_dir(cfg.model)
    with ThreadPoolExecutor(args.engines) as ex:
        procs = list(ex.map(lambda _: launch_embedded(model_dir, threads=args.engine_threads), range(args.engines)))
    try:
        worker = LearnerWorker(cfg, rank=0, world_size=1)
        out = asyncio.run(_measure(args, worker, [p.url for p in procs]))
    finally:
        for p in procs:
            p.stop()
    return {"model": "SmolLM2-135M fp32", "engines": args.engines, "transport": "gloo",
            "coalesce": not args.no_coalesce, "bucket_mb": args.bucket_mb, "baseline": "one flat broadcast, same bytes, same group",
            **out}
