"""Retrieval server throughput and retrieval quality on the synthetic Search-R1 corpus.

Starts the real server (`asyncrl retriever serve`, `--method bm25` or dense) over a generated world and measures, over
HTTP on loopback:
  - baseline: one query per request, one request at a time (queries per second);
  - concurrent: one query per request, `--concurrency` requests in flight (httpx.AsyncClient);
  - batched: `--batch` queries per request, one request at a time.
The three run interleaved for `--rounds` rounds (asyncrl/bench/rounds.py); each is reported by its
median with its spread, and ratios (against the baseline) are ratios of medians. Quality: for every question, whether its first-hop document
(the entity named in the question) is in the top-k hits for the question text itself (hit@k), and
whether the second-hop document is in the top-k for the bridge entity's name.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.envs.search_r1.corpus import make_world, write_corpus
from asyncrl.envs.search_r1.launcher import start_retriever


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=int, default=4096, help="world size, in questions")
    parser.add_argument("--requests", type=int, default=400, help="queries per measured mode")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="bm25", choices=["bm25", "dense"])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds; medians are reported")


def _title(hit: dict[str, Any]) -> str:
    return hit["document"]["contents"].split("\n", 1)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = make_world(args.seed, args.questions)
    questions = world.questions()
    queries = [q.question for q in questions]
    n = min(args.requests, len(queries))
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-retriever-") as tmp:
        corpus = write_corpus(world.documents(), Path(tmp) / "corpus.jsonl")
        t0 = time.perf_counter()
        proc = start_retriever(corpus, method=args.method, log_dir=tmp, timeout=1800)
        startup_s = time.perf_counter() - t0
        try:
            url, k = proc.retrieve_url, args.topk
            with httpx.Client(timeout=60) as client:
                client.post(url, json={"queries": queries[:8], "topk": k})  # warm up

                def sequential() -> float:
                    t0 = time.perf_counter()
                    for q in queries[:n]:
                        client.post(url, json={"queries": [q], "topk": k}).raise_for_status()
                    return n / (time.perf_counter() - t0)

                def batched() -> float:
                    t0 = time.perf_counter()
                    for i in range(0, n, args.batch):
                        client.post(url, json={"queries": queries[i:i + args.batch], "topk": k}).raise_for_status()
                    return n / (time.perf_counter() - t0)

                async def concurrent() -> float:
                    sem = asyncio.Semaphore(args.concurrency)
                    async with httpx.AsyncClient(timeout=60) as ac:
                        async def one(q: str) -> None:
                            async with sem:
                                (await ac.post(url, json={"queries": [q], "topk": k})).raise_for_status()

                        t = time.perf_counter()
                        await asyncio.gather(*(one(q) for q in queries[:n]))
                        return n / (time.perf_counter() - t)

                qps = interleave({"baseline": sequential, "concurrent": lambda: asyncio.run(concurrent()),
                                  "batched": batched}, args.rounds)

                def search_all(qs: list[str]) -> list[list[dict[str, Any]]]:
                    out: list[list[dict[str, Any]]] = []
                    for i in range(0, len(qs), 1024):
                        r = client.post(url, json={"queries": qs[i:i + 1024], "topk": k})
                        r.raise_for_status()
                        out.extend(r.json()["result"])
                    return out

                hits = search_all(queries)
                bridge = search_all([q.hops[1] for q in questions])
        finally:
            proc.stop()
    first_hop = sum(q.hops[0] in {_title(h) for h in hs} for q, hs in zip(questions, hits)) / len(questions)
    second_hop = sum(q.hops[1] in {_title(h) for h in hs} for q, hs in zip(questions, bridge)) / len(questions)
    return {
        "method": args.method,
        "documents": len(world.documents()),
        "queries_per_mode": n,
        "topk": args.topk,
        "server_startup_s": round(startup_s, 3),
        "baseline": "one query per request, sequential",
        "rounds": args.rounds,
        **summary("baseline_qps", qps["baseline"], 1),
        **summary("concurrent_qps", qps["concurrent"], 1),
        **summary("batched_qps", qps["batched"], 1),
        "concurrent_vs_baseline": ratio(qps["concurrent"], qps["baseline"], 2),
        "batched_vs_baseline": ratio(qps["batched"], qps["baseline"], 2),
        "concurrency": args.concurrency,
        "batch": args.batch,
        "question_hit_at_k_first_hop": round(first_hop, 3),
        "bridge_hit_at_k_second_hop": round(second_hop, 3),
    }
