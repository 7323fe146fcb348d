"""Learner throughput: one optimizer step on long-tailed variable-length sequences, packed vs padded.

The batch: `--num-seqs` sequences whose lengths are min_len * (max_len / min_len) ** (u ** 2), u uniform
(most short, a long tail), the longest set to max_len; a quarter of each (at most 64 tokens) is prompt,
the rest response (all trained). The same LearnerWorker (default model SmolLM2-135M, fp32 CPU) runs
one `train_step` (1 epoch, 1 minibatch, micro-batches cut by `--budget` tokens) with padded rows (the
baseline: sequences in batch order, each micro-batch padded to its longest) and one with packed rows.
The two run interleaved for `--rounds` rounds (asyncrl/bench/rounds.py). Reported: each side's median
seconds with its spread, real tokens per second at the median, ratio_packed_over_padded = the ratio of
median times, and ratio_cpu_time, the same ratio in median process CPU time (robust to other processes
sharing the CPU). A short warm-up step runs first.

With `--critic`, a third side: the same packed step of PPO (adv_estimator=gae: the critic's value forward,
GAE, the policy update, the critic's update) on a second worker, and ratio_ppo_over_grpo = its median
time over the packed GRPO step's: what the critic costs.

With `--lora R`, another side: the same packed step training LoRA adapters of rank R (model.lora.rank) on a
second worker, and ratio_lora_over_full = the full fine-tuning packed step's median time over its own (> 1: LoRA
is faster), with lora_tokens_per_s. With `--cpu-bf16`, a side with bf16 autocast (model.cpu_bf16) and
ratio_bf16_over_fp32, likewise the fp32 step's time over the bf16 one's.

With `--prompt-len P` (and `--group-size G`) the batch is GRPO-shaped: groups of G samples share one P-token
prompt, and the lengths drawn above are the responses' (the default run is about `--num-seqs 16
--group-size 4 --prompt-len 320 --system-len 280 --min-len 40 --max-len 400`; its warm start's SFT steps,
`--num-seqs 8 --group-size 1 --prompt-len 315 --system-len 280 --min-len 60 --max-len 75`). `--system-len S`:
every prompt starts with one S-token system prefix (what a chat template puts before each question). A side
"shared" scores the batch as one prefix tree (algorithm.share_prompts, asyncrl/learner/packing.py) and
ratio_shared_over_packed is the packed step's median time over its own (> 1: sharing is faster); a side
"shared_groups" shares each prompt within its own group only (the layout before trees spanned prompts), and
ratio_tree_over_groups is its median time over the "shared" side's; with `--cpu-bf16` also "shared_bf16"
(sharing and bf16 together) and ratio_shared_bf16_over_packed. Every other side scores each sample with its
own copy of the prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.config import AlgorithmConfig, Config, CriticConfig, LoraConfig, ModelConfig
from asyncrl.data.schema import Batch, Group, make_trajectory
from asyncrl.learner.worker import LearnerWorker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, default=10)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=4096, help="algorithm.micro_batch_tokens")
    parser.add_argument("--decoupled", action="store_true", help="include the proximal forward in the step")
    parser.add_argument("--model-path", default=None, help="a local HF directory instead of the default model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds; medians are reported")
    parser.add_argument("--critic", action="store_true", help="add PPO with a critic as a third side")
    parser.add_argument("--lora", type=int, default=0, help="add a LoRA side of this rank (0: none)")
    parser.add_argument("--cpu-bf16", action="store_true", help="add a side with bf16 autocast (model.cpu_bf16)")
    parser.add_argument("--group-size", type=int, default=1, help="samples sharing one prompt (> 1: a shared side)")
    parser.add_argument("--prompt-len", type=int, default=0,
                        help="each group's prompt tokens (> 0: lengths are the responses', and shared sides run)")
    parser.add_argument("--system-len", type=int, default=0,
                        help="with --prompt-len: the tokens of a system prefix every prompt starts with")


def check_batch_shape(args: argparse.Namespace) -> None:
    """SystemExit naming the first batch-shape flag whose value cannot make a batch (before any model loads)."""
    bad = [(args.num_seqs < 1, f"--num-seqs must be >= 1, got {args.num_seqs}"),
           (not 1 <= args.min_len <= args.max_len,
            f"--min-len and --max-len must satisfy 1 <= min <= max, got {args.min_len} and {args.max_len}"),
           (args.group_size < 1, f"--group-size must be >= 1, got {args.group_size}"),
           (args.prompt_len < 0, f"--prompt-len must be >= 0, got {args.prompt_len}"),
           (not 0 <= args.system_len <= args.prompt_len,
            f"--system-len must be in 0..--prompt-len ({args.prompt_len}), got {args.system_len}")]
    for is_bad, why in bad:
        if is_bad:
            raise SystemExit(f"asyncrl bench learner: {why}")


def lengths_long_tailed(n: int, lo: int, hi: int, seed: int) -> list[int]:
    u = np.random.default_rng(seed).random(n)
    lengths = (lo * (hi / lo) ** (u**2)).astype(int).clip(lo, hi)
    lengths[int(np.argmax(lengths))] = hi
    return [int(x) for x in lengths]


def make_batch(lengths: list[int], vocab: int, seed: int, group_size: int = 1, prompt_len: int = 0,
               system_len: int = 0):
    """Groups of 2 with prompts of a quarter of each length (at most 64); or, with prompt_len > 0, groups of
    group_size sharing one prompt_len-token prompt whose first system_len (<= prompt_len) tokens every prompt
    has, `lengths` being the responses'."""
    rng = np.random.default_rng(seed + 1)
    shared = prompt_len > 0
    size = group_size if shared else 2
    trajs, prompt = [], []
    system = rng.integers(10, vocab, system_len).tolist()
    for i, n in enumerate(lengths):
        if shared:
            if i % size == 0:
                prompt = system + rng.integers(10, vocab, prompt_len - len(system)).tolist()
            p, n = prompt_len, prompt_len + n
        else:
            p = min(64, max(1, n // 4))
            prompt = rng.integers(10, vocab, p).tolist()
        trajs.append(make_trajectory(
            uid=f"u{i}", group_id=f"g{i // size}", prompt_ids=prompt,
            response_ids=rng.integers(10, vocab, n - p).tolist(), loss_mask=[1] * (n - p),
            behavior_logprobs=[-2.0] * (n - p), versions=[0] * (n - p), reward=float(i % 2)))
    groups = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    return Batch(batch_id=0, groups=[Group(group_id=g, trajectories=ts, expected=len(ts)) for g, ts in groups.items()])


def run(args: argparse.Namespace) -> dict:
    check_batch_shape(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(model=ModelConfig(path=args.model_path) if args.model_path else ModelConfig(),
                 algorithm=AlgorithmConfig(lr=1e-7, micro_batch_tokens=args.budget, decoupled=args.decoupled))
    worker = LearnerWorker(cfg)
    vocab = int(worker.model.config.vocab_size)
    lengths = lengths_long_tailed(args.num_seqs, args.min_len, args.max_len, args.seed)
    batch = make_batch(lengths, vocab, args.seed, args.group_size, args.prompt_len, args.system_len)
    shared = args.prompt_len > 0
    real_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch.trajectories())
    worker.train_step(make_batch([args.min_len, args.min_len], vocab, args.seed + 7))  # warm-up
    out: dict = {"model": str(worker.model.config.name_or_path).split("/")[-1], "lengths": lengths,
                 "real_tokens": real_tokens, "group_size": args.group_size if shared else 1,
                 "prompt_len": args.prompt_len if shared else None,
                 "system_len": args.system_len if shared else None, "budget": args.budget, "decoupled": args.decoupled,
                 "threads": torch.get_num_threads()}
    workers = {"padded": worker, "packed": worker}
    if args.critic:
        workers["ppo"] = LearnerWorker(Config(model=cfg.model, algorithm=AlgorithmConfig(
            lr=1e-7, micro_batch_tokens=args.budget, decoupled=args.decoupled, adv_estimator="gae",
            critic=CriticConfig(lr=1e-7))))
        workers["ppo"].train_step(make_batch([args.min_len, args.min_len], vocab, args.seed + 7))  # warm-up

    if args.cpu_bf16:
        workers["bf16"] = LearnerWorker(replace(cfg, model=replace(cfg.model, cpu_bf16=True)))
        workers["bf16"].train_step(make_batch([args.min_len, args.min_len], vocab, args.seed + 7))  # warm-up
    if args.lora:
        workers["lora"] = LearnerWorker(replace(cfg, model=replace(cfg.model, lora=LoraConfig(rank=args.lora))))
        workers["lora"].train_step(make_batch([args.min_len, args.min_len], vocab, args.seed + 7))  # warm-up

    def step(w: LearnerWorker, packing: bool, share: bool = False, across: bool = True) -> tuple[float, float, int]:
        w.layout = replace(w.layout, packing=packing, share_prompts=share, across_prompts=across)
        t0, c0 = time.perf_counter(), time.process_time()
        m = w.train_step(batch)
        return time.perf_counter() - t0, time.process_time() - c0, int(m["learner/compute_tokens_rank"])

    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in workers}

    def side(name: str, packing: bool, worker: str | None = None, share: bool = False, across: bool = True):
        def one() -> float:
            runs[name].append(step(workers[worker or name], packing, share, across))
            return runs[name][-1][0]
        return one

    sides = {"padded": side("padded", False), "packed": side("packed", True)}
    if shared:
        runs["shared"] = []
        sides["shared"] = side("shared", True, worker="packed", share=True)
        runs["shared_groups"] = []
        sides["shared_groups"] = side("shared_groups", True, worker="packed", share=True, across=False)
        if args.cpu_bf16:  # shared prompts and bf16 together: the default run's learner on this CPU
            runs["shared_bf16"] = []
            sides["shared_bf16"] = side("shared_bf16", True, worker="bf16", share=True)
    if args.critic:
        sides["ppo"] = side("ppo", True)
    if args.lora:
        sides["lora"] = side("lora", True)
    if args.cpu_bf16:
        sides["bf16"] = side("bf16", True)
    seconds = interleave(sides, args.rounds)
    out["rounds"] = args.rounds
    if args.critic:
        out.update(summary("ppo_seconds", seconds["ppo"]))
        out["ratio_ppo_over_grpo"] = ratio(seconds["ppo"], seconds["packed"])
    if args.cpu_bf16:
        out.update(summary("bf16_seconds", seconds["bf16"]))
        out["bf16_native"] = workers["bf16"].cpu_bf16
        out["bf16_tokens_per_s"] = round(real_tokens / statistics.median(seconds["bf16"]), 1)
        out["ratio_bf16_over_fp32"] = ratio(seconds["packed"], seconds["bf16"])  # > 1: bf16 is faster
    if shared:
        out.update(summary("shared_seconds", seconds["shared"]))
        out["shared_compute_tokens"] = runs["shared"][-1][2]
        out["shared_tokens_per_s"] = round(real_tokens / statistics.median(seconds["shared"]), 1)
        out["ratio_shared_over_packed"] = ratio(seconds["packed"], seconds["shared"])  # > 1: sharing is faster
        out.update(summary("shared_groups_seconds", seconds["shared_groups"]))
        out["shared_groups_compute_tokens"] = runs["shared_groups"][-1][2]
        out["ratio_tree_over_groups"] = ratio(seconds["shared_groups"], seconds["shared"])  # > 1: the tree is faster
        if args.cpu_bf16:
            out.update(summary("shared_bf16_seconds", seconds["shared_bf16"]))
            out["shared_bf16_tokens_per_s"] = round(real_tokens / statistics.median(seconds["shared_bf16"]), 1)
            out["ratio_shared_bf16_over_packed"] = ratio(seconds["packed"], seconds["shared_bf16"])
    if args.lora:
        out.update(summary("lora_seconds", seconds["lora"]))
        out["lora_rank"] = args.lora
        out["lora_tokens_per_s"] = round(real_tokens / statistics.median(seconds["lora"]), 1)
        out["ratio_lora_over_full"] = ratio(seconds["packed"], seconds["lora"])  # > 1: LoRA is faster
    for name in ("padded", "packed"):
        out.update(summary(f"{name}_seconds", seconds[name]))
        out[f"{name}_cpu_seconds"] = round(statistics.median(r[1] for r in runs[name]), 2)
        out[f"{name}_tokens_per_s"] = round(real_tokens / statistics.median(seconds[name]), 1)
        out[f"{name}_compute_tokens"] = runs[name][-1][2]
    out["ratio_packed_over_padded"] = ratio(seconds["padded"], seconds["packed"])
    # the same ratio in process CPU time: less sensitive to other processes sharing the machine
    out["ratio_cpu_time"] = round(out["padded_cpu_seconds"] / max(out["packed_cpu_seconds"], 1e-9), 3)
    return out
