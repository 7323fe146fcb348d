"""What `asyncrl eval` and `asyncrl generate` share: the config, one engine on the model, and the agent loops.

No Ray, no buffer, no learner: the command composes the config (a run dir's recorded overrides first, then
the user's), starts the env's services (e.g. the retrieval server), launches one engine on the model the
same way a training run does (asyncrl/engine/launcher.py `launch_configured`; or attaches to `engine.urls`),
and runs episodes through the configured agent loop with the env's own reward. Each episode gets a sampling
seed fixed by (seed, row, sample index), so two checkpoints sample with the same seeds. The draws repeat
exactly only where the logits do: a fresh engine running one episode at a time does; batching (whose
composition depends on timing) and an engine's earlier work can change float rounding.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from asyncrl import registry
from asyncrl.config import Config, load_config
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_configured
from asyncrl.models import load_tokenizer, resolve_model_dir
from asyncrl.offline.checkpoints import ModelSource
from asyncrl.sandbox.runner import hide_job_paths
from asyncrl.util.cpus import available_cpus
from asyncrl.util.net import free_port
from asyncrl.util.seeds import derive_seed


class OfflineError(Exception):
    """A usage or setup mistake caught before any episode runs: the command exits 2 with it."""


def episode_seed(seed: int, data_index: int, sample_index: int) -> int:
    """A sampling seed fixed by the three numbers (the same for every checkpoint: asyncrl/util/seeds.py)."""
    return derive_seed(seed, data_index, sample_index)


def compose_config(source: ModelSource, overrides: list[str]) -> Config:
    """The run's recorded overrides (if MODEL lies in a run dir), then the user's, then MODEL itself."""
    model = []
    if source.hf_dir is not None:
        model = [f"model.path={source.hf_dir}"]
    elif source.training_checkpoint is None and source.label != "base model":
        model = [f"model.path={source.label}"]  # a hub id, resolved offline like any model.path
    return load_config([*source.run_overrides, *overrides, *model])


def prepare_model(cfg: Config, source: ModelSource, work_dir: Path, say: Callable[[str], None]) -> Config:
    """`cfg` with model.path at an HF dir: a training checkpoint is exported into `work_dir/model` first."""
    if source.training_checkpoint is None:
        return cfg
    # lazy: imports huggingface_hub, transformers, which this module does not load otherwise
    from asyncrl.learner.export import export_checkpoint

    dest = work_dir / "model"
    say(f"exporting {source.training_checkpoint} to {dest}")
    export_checkpoint(source.training_checkpoint, dest)
    return replace(cfg, model=replace(cfg.model, path=str(dest)))


@contextlib.contextmanager
def agent_context(cfg: Config, work_dir: Path, say: Callable[[str], None], hide: Sequence[str | Path] = ()
                  ) -> Iterator[Any]:
    """Yields an AgentContext whose engine serves `cfg.model`, with the env's services running; the
    sandbox hides `work_dir`, `hide` and the job's files from every program it runs (`hide_job_paths`)."""
    # lazy: imports omegaconf, pyarrow, which this module does not load otherwise
    from asyncrl.agents.base import AgentContext

    # lazy: imports pyarrow, which this module does not load otherwise
    from asyncrl.envs.base import resolve_env

    registry.load_all(cfg.plugins, learner=False)  # no loss is looked up here: no torch
    # what model-written code in the python tool may never read: the job's output (episodes with their
    # rewards and answers), the data and reward files, and any dirs the caller names (eval's --against)
    hide_job_paths(cfg, work_dir, *hide)
    env = resolve_env(cfg.env.name)
    model_dir = str(resolve_model_dir(cfg.model))
    with env.services(cfg.env) as tool_overrides:
        proc = None
        if cfg.engine.urls:
            urls = list(cfg.engine.urls)
            say(f"using the engine(s) at {', '.join(urls)} (engine.urls: whatever model they serve is measured)")
        else:
            say(f"launching the {cfg.engine.type} engine on {model_dir}")
            proc = launch_configured(cfg, model_dir, port=free_port(cfg.engine.host), threads=available_cpus(),
                                     log_dir=str(work_dir / "engine"))
            urls = [proc.url]
        try:
            e = cfg.engine
            yield AgentContext.for_config(
                cfg, EngineClient(urls, timeout_s=e.request_timeout_s, max_retries=e.max_retries),
                load_tokenizer(cfg.model), tool_overrides)
        finally:
            if proc is not None:
                proc.stop()


@dataclass
class EpisodeResult:
    data_index: int
    sample_index: int
    seed: int
    row: dict[str, Any]
    trajectory: Any = None  # asyncrl.data.schema.Trajectory, None when the episode failed
    error: str = ""
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        """The episode as one JSON line (what eval writes to episodes.jsonl)."""
        t = self.trajectory
        return {
            "data_index": self.data_index, "sample_index": self.sample_index, "seed": self.seed,
            "data_source": self.row.get("data_source") or "",
            "ground_truth": (self.row.get("reward_model") or {}).get("ground_truth"),
            "reward": t.reward if t is not None else 0.0, "error": self.error,
            "num_turns": t.num_turns if t is not None else 0, "finish_reason": t.finish_reason if t else "error",
            "metrics": dict(t.metrics) if t is not None else {}, "seconds": round(self.seconds, 3),
            "messages": list(t.messages) if t is not None else [],
        }

    def response(self) -> str:
        """The last assistant message's text: what a generation job keeps as the response."""
        msgs = self.trajectory.messages if self.trajectory is not None else []
        return next((str(m.get("content") or "") for m in reversed(msgs) if m.get("role") == "assistant"), "")


async def run_rows(ctx: Any, agent: str, rows: list[tuple[int, dict[str, Any]]], n: int, seed: int,
                   concurrency: int, on_row: Callable[[int, list[EpisodeResult]], Optional[Awaitable[None]]]) -> None:
    """Run `n` episodes of each (data_index, row), at most `concurrency` at once; `on_row(data_index, results)`
    when a row's n episodes are all done (in completion order). A failed episode is a result with `error`."""
    # lazy: imports omegaconf, pyarrow, which this module does not load otherwise
    from asyncrl.agents.base import run_episode
    from asyncrl.envs.base import Sample

    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, row: dict[str, Any], s: int) -> EpisodeResult:
        sd = episode_seed(seed, i, s)
        sample = replace(Sample.from_row(row, data_index=i, group_id=f"offline-{i}", sample_index=s, group_size=n),
                         sampling_seed=sd)
        async with sem:
            t0 = time.perf_counter()
            try:
                traj = await run_episode(sample, ctx, agent)
                return EpisodeResult(i, s, sd, row, traj, seconds=time.perf_counter() - t0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                return EpisodeResult(i, s, sd, row, error=f"{type(e).__name__}: {e}"[:500],
                                     seconds=time.perf_counter() - t0)

    async def row_job(i: int, row: dict[str, Any]) -> None:
        results = list(await asyncio.gather(*(one(i, row, s) for s in range(n))))
        done = on_row(i, results)
        if done is not None:
            await done

    await asyncio.gather(*(row_job(i, row) for i, row in rows))


def load_split(cfg: Config, split: str, limit: Optional[int] = None, data_file: Optional[str] = None
               ) -> list[tuple[int, dict[str, Any]]]:
    """(data_index, row) of the split's first `limit` rows (all by default), or of `data_file`, each row
    checked here: bad rows are an OfflineError naming up to five of them, before any engine starts."""
    # lazy: imports pyarrow, which this module does not load otherwise
    from asyncrl.data.dataset import open_dataset
    from asyncrl.data.rows import DataError
    from asyncrl.envs.base import load_rows, resolve_env

    registry.load_all(cfg.plugins, learner=False)  # no loss is looked up here: no torch
    try:
        ds = open_dataset(data_file) if data_file else load_rows(cfg, resolve_env(cfg.env.name), split)
    except DataError as e:
        raise OfflineError(str(e)) from None
    what = data_file or f"the {split} split of env={cfg.env.name}"
    n = len(ds) if limit is None else min(limit, len(ds))
    rows, bad = [], []
    for i in range(n):
        try:
            rows.append((i, ds[i]))
        except DataError as e:
            bad.append(str(e))
    if bad:
        raise OfflineError(f"{len(bad)} bad row(s) in {what}: " + "; ".join(bad[:5]))
    if not rows:
        raise OfflineError(f"{what} has no rows")
    return rows
