"""The contracts between a dataset row, an environment and the rollout side.

A dataset row follows verl's parquet schema: `data_source`, `prompt` (chat messages), `ability`,
`reward_model.ground_truth`, `extra_info` (with optional `tools_kwargs` and `interaction_kwargs`)
and an optional `agent_name`. `Sample` is one such row prepared for one episode of a group.

An env plugin (`@register("env", name)`) is a subclass of `Env`: it builds datasets and scores
final answers. A custom reward (`env.reward.path=file.py env.reward.name=fn`) replaces the env's.

A reward function is called with the keyword arguments it names (`reward_arguments`), from asyncrl's
(`final_text`: the last assistant message; `ground_truth`, `extra_info`, `tool_rewards`, `turn_rewards`)
and verl's (`compute_score(data_source, solution_str, ground_truth, extra_info)`, where `solution_str`
is the whole response decoded as verl's reward manager does, tool replies included; the OpenAI-client
agent's is its last completion's text), so a verl reward file loads unchanged; one that takes `**kwargs`
gets asyncrl's five as before (besides what it names), unless it names verl's `data_source` or
`solution_str` (verl's own functions take `**kwargs` too): then it gets only what it names.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl import registry
from asyncrl.data.dataset import Dataset, open_dataset
from asyncrl.data.schema import NonFiniteRewardError


@dataclass
class DemoCall:
    """One tool call of a demonstration turn: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class DemoTurn:
    """One assistant turn of a demonstration: its text and the tool calls it makes (after the text)."""

    content: str
    tool_calls: list[DemoCall] = field(default_factory=list)


class DemoError(ValueError):
    """A row that cannot be demonstrated (the env cannot solve it, or its solution did not earn full reward)."""



@dataclass
class Sample:
    """One episode's input: a dataset row plus its place in a GRPO group."""

    uid: str
    group_id: str
    group_size: int
    sample_index: int
    data_index: int
    messages: list[dict[str, Any]]
    ground_truth: Any = None
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    agent_name: Optional[str] = None
    # a fixed sampling seed for the episode (offline evaluation: the same seed for the same row and sample
    # index, whatever the checkpoint); its assistant turn t samples with seed + t. None: the engine's own
    sampling_seed: Optional[int] = None

    @property
    def tools_kwargs(self) -> dict[str, Any]:
        return dict(self.extra_info.get("tools_kwargs") or {})

    @property
    def interaction_kwargs(self) -> Optional[dict[str, Any]]:
        kw = self.extra_info.get("interaction_kwargs")
        return dict(kw) if kw else None

    @classmethod
    def from_row(cls, row: dict[str, Any], *, data_index: int, group_id: str, sample_index: int,
                 group_size: int) -> Sample:
        prompt = row["prompt"]
        messages = [dict(m) for m in (list(prompt) if not isinstance(prompt, str) else [{"role": "user", "content": prompt}])]
        reward_model = row.get("reward_model") or {}
        return cls(
            uid=f"{group_id}-{sample_index}",
            group_id=group_id,
            group_size=group_size,
            sample_index=sample_index,
            data_index=data_index,
            messages=messages,
            ground_truth=reward_model.get("ground_truth"),
            data_source=row.get("data_source") or "",
            extra_info=dict(row.get("extra_info") or {}),
            agent_name=row.get("agent_name") or None,
        )


class Env:
    """Base class of environment plugins. Subclasses set `name` and implement `build` and `reward`."""

    name: str = ""

    def build(self, cfg: Any, split: str) -> list[dict[str, Any]]:
        """Rows in verl's schema for `split` ("train" or "val"); deterministic in `cfg.seed`."""
        raise NotImplementedError

    def reward(self, *, final_text: str, ground_truth: Any, extra_info: dict[str, Any],
               tool_rewards: list[float], turn_rewards: list[float]) -> float | dict[str, Any]:
        """Score one finished episode: a float, or a dict with `score` (and any extra metrics)."""
        raise NotImplementedError

    def demo_turns(self, row: dict[str, Any]) -> list[Any]:
        """How to solve `row`: the assistant turns (`DemoTurn`: text and tool calls) of a
        demonstration, checked by playing them through the agent loop. Optional: an env without it has no
        `asyncrl data <env> --demos`."""
        raise NotImplementedError(f"env {self.name!r} has no demonstrations (it does not implement demo_turns)")

    def check_demo(self, row: dict[str, Any], messages: list[dict[str, Any]]) -> Optional[str]:
        """Beyond the full reward, why a played demonstration (the agent loop's `messages`) is not a good one,
        or None (the default: the reward's verdict is enough)."""
        return None

    def services(self, cfg: Any) -> Any:
        """A context manager that starts what the env needs (e.g. a retrieval server) and yields a
        dict of tool config updates {tool_name: {key: value}}; the default needs nothing."""
        return contextlib.nullcontext({})


ASYNCRL_REWARD_ARGS = ("final_text", "ground_truth", "extra_info", "tool_rewards", "turn_rewards")
VERL_REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def reward_arguments(reward_fn: Any) -> tuple[str, ...]:
    """The keyword arguments `reward_fn` is called with (module docstring); a TypeError naming the function
    and the parameter when it requires one that no caller gives (checked by the preflight)."""
    try:
        params = inspect.signature(reward_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: asyncrl's names
        return ASYNCRL_REWARD_ARGS
    known = set(ASYNCRL_REWARD_ARGS) | set(VERL_REWARD_ARGS)
    for p in params:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and (p.name not in known or p.kind is p.POSITIONAL_ONLY):
            name = getattr(reward_fn, "__qualname__", None) or type(reward_fn).__qualname__
            raise TypeError(f"reward function {name} requires {p.name!r}, which no caller gives: a reward is called "
                            f"with keywords among {', '.join(sorted(known))} (asyncrl's and verl's names)")
    named = tuple(p.name for p in params if p.name in known and p.kind is not p.POSITIONAL_ONLY)
    verl_style = {"data_source", "solution_str"} & set(named)
    if any(p.kind is p.VAR_KEYWORD for p in params) and not verl_style:  # `**kw`: asyncrl's five, as always
        return tuple(dict.fromkeys((*named, *ASYNCRL_REWARD_ARGS)))
    return named


@dataclass
class Deferred:
    """An argument computed only for a reward function that takes it (`solution_str`'s decoding)."""

    make: Callable[[], Any]


async def score(reward_fn: Any, **kwargs: Any) -> tuple[float, dict[str, float]]:
    """Call a sync or async reward function with the arguments it takes (`reward_arguments`) from
    `kwargs` (a `Deferred` value is computed then); return (score, extra numeric metrics)."""
    wanted = reward_arguments(reward_fn)
    args = {k: (v.make() if isinstance(v, Deferred) else v) for k, v in kwargs.items() if k in wanted}
    result = reward_fn(**args)
    if inspect.isawaitable(result):
        result = await result
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function {getattr(reward_fn, '__name__', reward_fn)} returned a dict without 'score': {result}")
        extra = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (int, float, bool))}
        return float(result["score"]), extra
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise TypeError(f"reward function {getattr(reward_fn, '__name__', reward_fn)} returned {result!r}; expected a float or a dict with 'score'")
    return float(result), {}


def checked_reward(reward: float, max_abs: float, source: str) -> float:
    """The episode's reward, or NonFiniteRewardError naming `source` (the reward function, or how an agent
    gave it) and the sample when it is not finite or beyond env.reward.max_abs."""
    if not math.isfinite(reward):
        raise NonFiniteRewardError(f"{source} returned {reward}: a reward must be a finite number")
    if abs(reward) > max_abs:
        raise NonFiniteRewardError(f"{source} returned {reward!r}, beyond env.reward.max_abs={max_abs:g}: "
                                   f"scale the reward down or raise the bound")
    return reward


def can_demonstrate(env: Any) -> bool:
    """Whether an env (a class or an instance) implements `Env.demo_turns`: what `asyncrl data <env> --demos`
    and the warm start need."""
    cls = env if isinstance(env, type) else type(env)
    return getattr(cls, "demo_turns", None) not in (None, Env.demo_turns)


def resolve_env(name: str) -> Env:
    cls = registry.get("env", name)
    return cls() if isinstance(cls, type) else cls


def resolve_reward_fn(env_cfg: Any) -> Any:
    """The custom reward named in `env.reward` (file.py + function, or a registered reward), else the env's."""
    r = env_cfg.reward
    if r.path:
        if not r.name:
            raise ValueError(f"env.reward.path={r.path!r} needs env.reward.name (the function in that file)")
        fn = registry.resolve_object(f"{r.path}:{r.name}")
    elif r.name:
        fn = registry.get("reward", r.name)
    else:
        return resolve_env(env_cfg.name).reward
    reward_arguments(fn)  # one it cannot be called with fails here, in the preflight
    return fn


def load_rows(cfg: Any, env: Env, split: str) -> Dataset:
    """Rows of `split` ("train" or "val") as a `Dataset` (a Sequence of rows, see asyncrl/data/dataset.py):
    the configured parquet/jsonl file if one is named, opened without reading its rows (a missing
    file, a damaged footer or a missing column is a DataError naming it), else the rows the env builds."""
    path = cfg.env.train_file if split == "train" else cfg.env.val_file
    if path:
        return open_dataset(path, skip_bad=cfg.env.skip_bad_rows)
    return Dataset.from_rows(env.build(cfg.env, split), skip_bad=cfg.env.skip_bad_rows)
