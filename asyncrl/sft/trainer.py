"""`asyncrl sft DATA [--val FILE] [--out DIR] [--epochs E] [--batch B] [--lr LR] [overrides...]`: supervised warm start.

The same learner as RL (asyncrl/learner/worker.py `LearnerWorker`, one rank in this process) trains on the
rendered conversations (asyncrl/sft/conversations.py: loss on exactly the assistant turns' tokens) with the `sft`
loss, the mean negative log-likelihood per token (`algorithm.loss_agg`), at temperature 1. Config: the
usual Hydra overrides (model, agent: its system prompt, tool parser and token budgets; algorithm: packing,
micro_batch_tokens, lr schedule, warmup), with these fixed for SFT: loss=sft, decoupled=false,
max_staleness=0, kl_coef=0, one epoch and one minibatch per step (the batch is the optimizer step).

Schedule: each epoch visits every row once in an order shuffled by (seed, epoch); step k trains on the k-th
batch of that schedule, so a resumed run continues exactly where its checkpoint left off. Every
--val-every steps (and at the end) the validation loss (mean NLL per assistant token of --val, no update)
is logged. Checkpoints (DCP, atomic, `checkpoints/step_N`, holding the schedule position) every
--checkpoint-every steps and at the end; a run started again on the same --out resumes from the newest one;
the trained model is exported to OUT/final (a plain HF dir): `asyncrl train model.path=OUT/final` starts
RL from it. metrics.jsonl gets sft/train_loss, sft/val_loss, sft/lr, sft/tokens_per_s and memory/learner_peak_gb per step.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from asyncrl import registry
from asyncrl.config import ConfigError, load_config
from asyncrl.metrics import MetricsLogger
from asyncrl.models import load_tokenizer
from asyncrl.run_dir import RunLayout, latest_checkpoint
from asyncrl.util.stop_signals import interrupted, stopping_on_signals

RAW_ARGS = True  # Hydra overrides mix with the flags: parsed here


class SftError(ValueError):
    """An SFT job that cannot run as asked (its --out holds a checkpoint of a different job)."""


@dataclass(frozen=True)
class SftPlan:
    """What an SFT job does besides its config: where it writes, its epochs, batch, learning rate and seed."""

    out: Path
    epochs: int
    batch: int
    lr: float
    seed: int = 0
    val_every: int = 0  # steps between validation losses (0: only at the end)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)


@dataclass(frozen=True)
class SftResult:
    steps: int
    final: Path  # the exported HF dir
    train_loss: float  # the last step's
    resumed_at: int  # the step a checkpoint resumed the job at (0: from the start)
    peak_gb: float = 0.0  # the largest step's peak resident memory (memory/learner_peak_gb) in this job


def sft_config(cfg: Any, plan: SftPlan, n_steps: int) -> Any:
    """`cfg` with what SFT fixes: loss=sft (mean NLL per assistant token), no off-policy machinery (decoupled
    off, staleness 0, no KL), one epoch and one minibatch per step (the batch is the optimizer step), logits
    at temperature 1, the plan's lr, steps, output dir and seed."""
    algo = replace(cfg.algorithm, loss="sft", decoupled=False, max_staleness=0, kl_coef=0.0, epochs=1,
                   minibatches=1, adv_estimator="grpo", turn_credit=False, lr=plan.lr)
    agent = replace(cfg.agent, sampling=replace(cfg.agent.sampling, temperature=1.0))
    trainer = replace(cfg.trainer, total_steps=n_steps, output_dir=str(plan.out))
    return replace(cfg, algorithm=algo, agent=agent, trainer=trainer, seed=plan.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl sft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example:\n  asyncrl data arithmetic --demos --out demos\n"
                                       "  asyncrl sft demos/demos-train.jsonl --out outputs/sft\n"
                                       "  asyncrl train model.path=outputs/sft/final")
    p.add_argument("items", nargs="*", metavar="DATA | key=value", help="the training file and Hydra overrides")
    p.add_argument("--val", default=None, help="a validation file (same shape): its loss is logged")
    p.add_argument("--out", default="outputs/sft", help="output dir (default: %(default)s); resumed if it holds a "
                                                         "checkpoint")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="conversations per optimizer step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-every", type=int, default=0, help="steps between validation losses (0: only at the end)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


@dataclass
class SftBatch:
    """What LearnerWorker.train_step takes: the batch's trajectories."""

    batch_id: str
    trajs: list[Any]

    def trajectories(self) -> list[Any]:
        return self.trajs


def schedule(n_rows: int, epochs: int, batch: int, seed: int) -> list[list[int]]:
    """The row indices of every step: each epoch a (seed, epoch)-shuffled pass cut into batches (the last
    batch of an epoch may be smaller)."""
    steps = []
    for e in range(epochs):
        order = list(range(n_rows))
        random.Random(f"asyncrl-sft-{seed}-{e}").shuffle(order)
        steps += [order[i:i + batch] for i in range(0, n_rows, batch)]
    return steps


def main(args: argparse.Namespace) -> int:
    # lazy: imports pyarrow, which this module does not load otherwise
    from asyncrl.data.rows import DataError

    # lazy: imports pyarrow, which this module does not load otherwise
    from asyncrl.sft.conversations import read_rows, render_conversation

    a = build_parser().parse_intermixed_args(args.argv)
    data = [x for x in a.items if "=" not in x]
    overrides = [x for x in a.items if "=" in x]
    try:
        if len(data) != 1:
            raise ValueError(f"give exactly one training file (JSONL or parquet of `messages`), got {data or 'none'}")
        for name in ("epochs", "batch"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
        if not (a.lr > 0 and math.isfinite(a.lr)):
            raise ValueError(f"--lr must be a positive number, got {a.lr}")
        rows = read_rows(data[0])
        val_rows = read_rows(a.val) if a.val else []
        plan = SftPlan(out=Path(a.out), epochs=a.epochs, batch=a.batch, lr=a.lr, seed=a.seed,
                       val_every=a.val_every, checkpoint_every=a.checkpoint_every)
        cfg = sft_config(load_config(overrides), plan, len(schedule(len(rows), a.epochs, a.batch, a.seed)))
        registry.load_all(cfg.plugins)  # a tool_parser plugin writes the assistant turns (render_conversation)
        tok = load_tokenizer(cfg.model)
        trajs = [render_conversation(tok, cfg.agent, r, uid=f"sft-{i}") for i, r in enumerate(rows)]
        val = [render_conversation(tok, cfg.agent, r, uid=f"val-{i}") for i, r in enumerate(val_rows)]
    except (ValueError, ConfigError, DataError, registry.PluginError) as e:  # ToolFormatError is a ValueError
        print(f"asyncrl sft: {e}", file=sys.stderr)
        return 2

    with stopping_on_signals() as got:
        try:
            result = train(cfg, trajs, val, plan)
        except SftError as e:
            print(f"asyncrl sft: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return interrupted("asyncrl sft", got, f"the same command resumes from the last checkpoint in {a.out}")
    print(f"sft: {result.steps} steps; model in {result.final} (asyncrl train model.path={result.final})")
    return 0


def val_loss(worker: Any, trajs: list[Any]) -> float:
    """Mean NLL per assistant token of `trajs` under the worker's model (no update)."""
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.learner.packing import specs_of

    specs, masks = specs_of(trajs)
    logp = worker._score(worker.model, specs, list(range(len(specs))))
    nll = sum(float(-(logp[i][masks[i]]).sum()) for i in range(len(specs)))
    return nll / max(sum(int(m.sum()) for m in masks), 1)


def train(cfg: Any, trajs: list[Any], val: list[Any], plan: SftPlan, label: str = "") -> SftResult:
    """Train `cfg` (made by `sft_config`) on the rendered conversations `trajs` as `plan` says; resumes from the
    newest checkpoint in plan.out; exports plan.out/final; metrics in plan.out/metrics.jsonl. `label`: put before
    each progress line (asyncrl train's warm start)."""
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.learner.worker import LearnerWorker

    out = Path(plan.out)
    layout = RunLayout(out)  # an SFT dir holds metrics.jsonl, checkpoints/ and final/ as a run dir does
    out.mkdir(parents=True, exist_ok=True)
    steps = schedule(len(trajs), plan.epochs, plan.batch, plan.seed)
    latest: Optional[Path] = latest_checkpoint(layout.checkpoints)
    metrics = MetricsLogger(out, wandb_mode="off", progress=cfg.trainer.progress, total_steps=len(steps),
                            label=label)
    try:
        metrics.status(f"{label or 'sft: '}loading {cfg.model.path or cfg.model.name}")
        worker = LearnerWorker(cfg, rank=0, world_size=1)
        start = 0
        if latest is not None:
            extra = worker.load_checkpoint(str(latest))
            if extra.get("sft_steps") != len(steps) or extra.get("rows") != len(trajs):
                raise SftError(f"{latest} belongs to a different job ({extra.get('rows')} rows, "
                               f"{extra.get('sft_steps')} steps; this one: {len(trajs)} rows, {len(steps)} steps); "
                               "use another --out")
            start = int(extra["step"])
            metrics.status(f"{label or 'sft: '}resumed from {latest} at step {start}/{len(steps)}")
        per_epoch = math.ceil(len(trajs) / plan.batch)

        def save(step: int) -> None:
            worker.save_checkpoint(str(layout.checkpoint(step)),
                                   {"step": step, "sft_steps": len(steps), "rows": len(trajs)})

        loss, peak = float("nan"), 0.0
        for k in range(start, len(steps)):
            ts = time.perf_counter()
            m = worker.train_step(SftBatch(f"sft-step-{k + 1}", [trajs[i] for i in steps[k]]))
            loss = m["learner/pg_loss"]
            peak = max(peak, m["memory/learner_peak_gb"])
            rec = {"sft/train_loss": loss, "sft/lr": m["learner/lr"], "sft/epoch": k // per_epoch + 1,
                   "sft/tokens": m["learner/tokens"],
                   "sft/tokens_per_s": m["learner/tokens"] / (time.perf_counter() - ts),
                   "learner/grad_norm": m["learner/grad_norm"], "memory/learner_peak_gb": m["memory/learner_peak_gb"]}
            step = k + 1
            if val and ((plan.val_every and step % plan.val_every == 0) or step == len(steps)):
                rec["sft/val_loss"] = val_loss(worker, val)
            metrics.log(step, rec)
            if plan.checkpoint_every and step % plan.checkpoint_every == 0 and step < len(steps):
                save(step)
        if start < len(steps) or latest is None:
            save(len(steps))
        worker.export_hf(str(layout.final))
    finally:
        metrics.close()
    return SftResult(steps=len(steps), final=layout.final, train_loss=loss, resumed_at=start, peak_gb=peak)
