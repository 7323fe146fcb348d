"""The warm start of `asyncrl train` (`warm_start.mode`): demonstrations, SFT on them, then RL from that model.

What the three-command recipe does by hand (`asyncrl data <env> --demos`, `asyncrl sft`, `asyncrl train
model.path=...`), done by the run itself before any Ray actor starts:
1. demonstrations of the first `warm_start.demos` training rows (the rows RL draws from, as loaded), each
   played through the agent loop with the env's real tools and reward and kept only at full reward
   (asyncrl/sft/demos.py); rows without one are counted; a warm start that keeps none fails the run;
2. SFT on them with the RL learner (asyncrl/sft/trainer.py) for `warm_start.epochs` at `warm_start.lr`,
   `warm_start.batch` demonstrations a step;
3. RL starts from its export: `cfg.model.path` becomes RUN_DIR/warm_start/final, for the learner (and its
   reference model), the engines, the rollout workers' tokenizer and the run's config.json.

When: `on` always (the preflight refuses an env or agent that cannot demonstrate, or an agent.tool_parser
without `render`: `why_not`); `auto` when
the env and agent can and model.path is unset (the preset's base model; a model of the user's own, such as
an `asyncrl sft` export, is trained as it is), else RL starts from the configured model and the preflight
says why in one warning (`skipped_because`); `off` never.

On disk, RUN_DIR/warm_start/: `plan.json` (what made it: the base model, env, agent, warm_start settings
and seed), `demos-train.jsonl`, `metrics.jsonl` (SFT's steps), `checkpoints/`, `final/`, and `done.json`
(written last: the summary of a finished warm start). A start that finds `done.json` under the same plan
reuses the model (a resumed run); the same plan without it resumes SFT from its newest checkpoint; another
plan's directory is moved aside to `warm_start-discarded-<time>/` and the warm start runs again. A resumed
RL run whose directory has no finished warm start keeps its checkpoint's policy and runs none.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from asyncrl import registry
from asyncrl.agents.tool_calls import renderer
from asyncrl.config import Config, to_dict
from asyncrl.console_log import LOG_FORMAT, ConsoleLog
from asyncrl.envs.base import Env, can_demonstrate, resolve_env
from asyncrl.models import load_tokenizer
from asyncrl.run_dir import WARM_START_DISCARDED, RunLayout, timestamp_name
from asyncrl.sft import trainer as sft_trainer
from asyncrl.sft.conversations import read_rows, render_conversation
from asyncrl.sft.demos import demonstrate, write_demos
from asyncrl.util.memory import peak_gb
from asyncrl.util.stop_signals import stop_on_signals

log = logging.getLogger("asyncrl")

DEMO_AGENTS = ("tool_agent",)  # agent loops demonstrations are played through (calls in agent.tool_parser's format)


class WarmStartError(RuntimeError):
    """The warm start cannot give RL a model (no demonstration kept, or an SFT job it cannot resume)."""


@dataclass(frozen=True)
class WarmStart:
    """A finished warm start: the model RL starts from and what made it (done.json)."""

    model: Path
    summary: dict[str, Any]


def why_not(cfg: Config, env: Env, tokenizer: Any = None) -> Optional[str]:
    """Why this run cannot warm start (None: it can): the env must solve its rows (`Env.demo_turns`), the agent
    must replay demonstrations, and agent.tool_parser must write them (`render`; asyncrl/agents/tool_calls.py
    `renderer`). `tokenizer` resolves agent.tool_parser=auto (without one, auto is not checked here: the
    preflight passes the model's)."""
    if not can_demonstrate(env):
        return f"env {env.name!r} has no demonstrations (it does not implement demo_turns)"
    if cfg.agent.name not in DEMO_AGENTS:
        return (f"agent={cfg.agent.name}: demonstrations are played through {', '.join(DEMO_AGENTS)}, whose turns "
                f"are what SFT teaches")
    if cfg.agent.tool_parser != "auto" or tokenizer is not None:
        try:
            renderer(cfg.agent.tool_parser, tokenizer)
        except (ValueError, LookupError) as e:  # ToolFormatError, UnknownToolFormat, an unknown name
            return str(e)
    return None


def skipped_because(cfg: Config, env: Env, tokenizer: Any = None) -> Optional[str]:
    """Why `warm_start.mode` (auto or on) runs no warm start here, or None when it runs: `why_not`, and for
    auto also a model of the user's own (model.path set: an SFT export, a checkpoint), which RL takes as is."""
    reason = why_not(cfg, env, tokenizer)
    if reason is None and cfg.warm_start.mode == "auto" and cfg.model.path:
        reason = (f"model.path={cfg.model.path} is set (a model of your own; warm_start.mode=on fine-tunes it on "
                  f"demonstrations first)")
    return reason


def plan_of(cfg: Config) -> dict[str, Any]:
    """What decides the warm start's model: reused only by a start with the same plan."""
    agent = {k: v for k, v in to_dict(cfg.agent).items() if k != "sampling"}  # SFT fixes its temperature
    return {"model": to_dict(cfg.model), "env": to_dict(cfg.env), "agent": agent,
            "warm_start": to_dict(cfg.warm_start), "seed": cfg.seed}


def warm_start_in_child(cfg: Config, rows: list[dict[str, Any]], out: Path, resuming_rl: bool,
                        secrets: list[str]) -> Optional[WarmStart]:
    """`run_warm_start` as `asyncrl train` calls it, in a child process of its own (asyncrl/util/isolated.py):
    sets up what the driver had (its log format, its console record in RUN_DIR/train.log with `secrets`
    redacted, the stop signals, the config's plugins), then runs it on `rows` (the first `warm_start.demos`
    training rows)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    stop_on_signals()
    registry.load_all(cfg.plugins)
    with ConsoleLog(out, secrets, banner=None):
        return run_warm_start(cfg, resolve_env(cfg.env.name), rows, out, resuming_rl)


def run_warm_start(cfg: Config, env: Env, rows: Any, out: Path, resuming_rl: bool) -> Optional[WarmStart]:
    """Run (or reuse) the warm start of the run in `out`; None when it does not run (mode off, or `resuming_rl`
    from a checkpoint of a run that had none). Raises WarmStartError; KeyboardInterrupt passes through (SFT's
    checkpoints are kept, and the next start with the same plan resumes them)."""
    ws = cfg.warm_start
    if ws.mode == "off" or skipped_because(cfg, env) is not None:
        return None
    d = RunLayout(out).warm_start
    plan = json.loads(json.dumps(plan_of(cfg)))  # as read back from plan.json (tuples are lists there)
    plan_file, done_file = d / "plan.json", d / "done.json"
    if d.exists():
        old = _read_json(plan_file)
        if old != plan:
            aside = out / WARM_START_DISCARDED.named(timestamp_name())
            log.warning("warm start: %s was made %s; moved to %s, starting again", d,
                        "by another plan (model, env, agent, warm_start or seed differ)" if old else "without a plan",
                        aside)
            os.replace(d, aside)
        elif (done := _read_json(done_file)) is not None:
            log.info("warm start: reusing the finished warm start in %s", d)
            return WarmStart(RunLayout(d).final, done)  # where the run dir is now, wherever it was then
    if resuming_rl:
        log.warning("warm start: resuming RL from its checkpoint; this run had no finished warm start, so none "
                    "is run (the checkpoint holds the policy)")
        return None
    d.mkdir(parents=True, exist_ok=True)
    _write_json(plan_file, plan)
    t0 = time.monotonic()
    demos_path, kept, rejected = make_demo_file(cfg, env, rows[: ws.demos], d)
    result = fine_tune(cfg, demos_path, d)
    summary = {"model": str(result.final), "demos": kept, "rejected": rejected, "sft_steps": result.steps,
               "sft_train_loss": result.train_loss, "resumed_at_step": result.resumed_at,
               "seconds": round(time.monotonic() - t0, 1),
               # this process's peak (the warm start's own in `asyncrl train`, where it has a process of its own):
               # its largest SFT step's (each step starts the peak again) or what came after the last
               "peak_rss_gb": round(max(result.peak_gb, peak_gb()), 3)}
    _write_json(done_file, summary)
    log.info("warm start: %d demonstrations (%d rows had none), %d SFT steps, last loss %.4f, %.0f s; RL starts "
             "from %s", kept, rejected, result.steps, result.train_loss, summary["seconds"], result.final)
    return WarmStart(result.final, summary)


def make_demo_file(cfg: Config, env: Env, rows: list[dict[str, Any]], d: Path) -> tuple[Path, int, int]:
    """Solve and check `rows` (asyncrl/sft/demos.py) into d/demos-train.jsonl (atomic; reused when present:
    seeded, so the same plan makes the same file). Returns (path, demonstrations kept, rows rejected)."""
    path = d / "demos-train.jsonl"
    counts = d / "demos.json"
    if path.exists() and (c := _read_json(counts)) is not None:
        return path, int(c["kept"]), int(c["rejected"])
    log.info("warm start: solving %d training rows as demonstrations", len(rows))
    report = demonstrate(cfg, env, list(enumerate(rows)))
    for i, why in report.rejected[:5]:
        log.warning("warm start: training row %d has no demonstration: %s", i, why)
    if not report.rows:
        raise WarmStartError(f"none of the first {len(rows)} training rows of env {cfg.env.name!r} gave a "
                             f"demonstration that earns the full reward (first reason: "
                             f"{report.rejected[0][1] if report.rejected else 'no rows'}); set warm_start.mode=off")
    write_demos(report.rows, path)
    _write_json(counts, {"kept": len(report.rows), "rejected": len(report.rejected)})
    return path, len(report.rows), len(report.rejected)


def fine_tune(cfg: Config, demos_path: Path, d: Path) -> Any:
    """SFT on the demonstrations with the RL learner, in this process; its memory is freed before RL."""
    ws = cfg.warm_start
    rows = read_rows(demos_path)
    plan = sft_trainer.SftPlan(out=d, epochs=ws.epochs, batch=ws.batch, lr=ws.lr, seed=cfg.seed)
    scfg = sft_trainer.sft_config(cfg, plan, len(sft_trainer.schedule(len(rows), ws.epochs, ws.batch, cfg.seed)))
    tok = load_tokenizer(scfg.model)
    trajs = [render_conversation(tok, scfg.agent, r, uid=f"warm-{i}") for i, r in enumerate(rows)]
    try:
        return sft_trainer.train(scfg, trajs, [], plan, label="warm start: ")  # looked up here: tests replace it
    except sft_trainer.SftError as e:
        raise WarmStartError(f"{e} (in {d})") from None
    finally:  # the learner's tensors go with it: the engines and the RL learner need the memory (or GPU) next
        gc.collect()
        # lazy: imports torch, which this module does not load otherwise
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2))
    tmp.replace(path)
