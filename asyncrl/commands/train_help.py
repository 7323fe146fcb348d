"""`asyncrl train --help`: the config groups with their options, and the most used keys with their
defaults and a one-line description.

One source for both the schema and the help: a key's description is data on its field in
asyncrl/config.py (`setting(default, "description")`, read with `describe_field`), so the help cannot
drift from the declarations. Defaults come from the schema (`Config()`) merged with the
default config groups (configs/config.yaml), i.e. what a bare `asyncrl train` runs with.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from asyncrl.config import Config, compose, config_dir, describe_field, group_options

COMMON_KEYS = (
    "model.path", "engine.type", "engine.num_engines", "agent.max_turn_tokens", "agent.max_response_tokens",
    "agent.tool_parser", "agent.sampling.temperature", "env.train_file", "env.num_train",
    "algorithm.adv_estimator", "algorithm.loss", "algorithm.lr", "algorithm.n_samples", "algorithm.max_staleness",
    "algorithm.kl_coef", "trainer.mode", "trainer.total_steps", "trainer.max_minutes", "trainer.batch_groups", "trainer.rollout_workers",
    "trainer.learner_ranks", "trainer.run_name", "trainer.output_dir", "trainer.resume", "trainer.checkpoint_every",
    "trainer.eval_every", "trainer.wandb", "warm_start.mode", "warm_start.demos",
)


def key_fields() -> dict[str, dataclasses.Field]:
    """Dotted key -> (class name, field name) for every leaf of the schema."""
    out: dict[str, dataclasses.Field] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], key + ".")
            else:
                out[key] = f

    walk(Config, "")
    return out


def describe(keys: tuple[str, ...] = COMMON_KEYS) -> list[tuple[str, Any, str]]:
    """(key, default, description) for `keys`; KeyError naming a key the schema does not have."""
    fields = key_fields()
    defaults = compose([])
    rows = []
    for key in keys:
        if key not in fields:
            raise KeyError(f"{key!r} is not a key of the config schema")
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        rows.append((key, value, describe_field(fields[key])))
    return rows


def render() -> str:
    groups = sorted(p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))
    default_yaml = (config_dir() / "config.yaml").read_text()
    lines = ["Config groups (GROUP=OPTION; the default first):"]
    for g in groups:
        options = group_options(g) or []
        chosen = next((o for o in options if f"{g}: {o}" in default_yaml), None)
        ordered = ([chosen] if chosen else []) + [o for o in options if o != chosen]
        lines.append(f"  {g:<10} {', '.join(ordered)}")
    lines.append("\nMost used keys (KEY=VALUE; default; what it is):")
    for key, default, text in describe():
        lines.append(f"  {key:<30} {default!s:<14} {text}")
    lines.append("\nEvery key: asyncrl train --cfg job [overrides]   (the resolved config); "
                 "the schema with every description: asyncrl/config.py")
    return "\n".join(lines)
