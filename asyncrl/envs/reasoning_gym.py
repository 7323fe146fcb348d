"""env `reasoning_gym`: procedurally generated reasoning tasks from the reasoning-gym package, offline.

`env=reasoning_gym` trains on the tasks listed in `env.options.datasets` (the preset's default: three tasks
sized for a 135M model), each an entry `NAME` or `{name: NAME, weight: W, config: {...}}`, where `config`
holds the task's own settings (its `*Config` dataclass in reasoning-gym: difficulty ranges and the like).
Nothing is downloaded: reasoning-gym generates every row from a seed.

Rows: each row draws its task by weight (seeded by env.seed and the split) and takes that task's next
entry; the prompt asks for the answer inside `<answer>...</answer>`; the row's `data_source` is
`reasoning_gym/<task>` (so `asyncrl eval` reports per task) and `extra_info.reasoning_gym` names the entry
(task, config as JSON, seed, index), from which the reward regenerates it exactly. Train and val use
different seeds and no val question appears in train.

Reward: the task's own verifier, `score_answer(answer, entry)` on the text inside the reply's last
`<answer>` tags (a float in [0, 1]); reported also as `reward/correct` (the score is 1) and
`reward/formatted` (the reply had answer tags). `env.options.format_reward=F` (in [0, 1); the preset: 0.1)
gives F to a training reply with answer tags that the verifier scores 0, as the arithmetic env does: the
untrained 135M model puts its answer in tags in about 2% of replies (measured: `asyncrl eval
env=reasoning_gym`) and is right in none, so without it nearly every group's rewards are equal. Validation
rows never carry it. The instruction to answer in tags follows the question in the user turn (in a system
prompt, 0.4% of the same model's replies used the tags).

Demonstrations (`demo_turns`): the task's own answer in tags, one turn; so `warm_start.mode=auto` (the
default) first fine-tunes on them, teaching the answer format the untrained model almost never uses.

The package is an optional extra (`pip install -e ".[envs]"`, which scripts/setup.sh installs); without it,
building rows or scoring fails with that command, which the preflight reports before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import random
import re
from pathlib import Path
from typing import Any, Optional

from asyncrl.config import EnvConfig, load_config
from asyncrl.data.rows import write_rows
from asyncrl.envs.base import DemoError, DemoTurn, Env
from asyncrl.registry import register
from asyncrl.util.seeds import derive_seed

PACKAGE = "reasoning-gym"
INSTALL = 'pip install -e ".[envs]" (or pip install reasoning-gym==0.1.25)'
DATA_SOURCE_PREFIX = "reasoning_gym/"
SPLIT_IDS = {"train": 0, "val": 1}
INSTRUCTION = ("\n\nGive only the final answer between <answer> and </answer> tags, for example "
               "<answer>42</answer>.")
_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
OPTIONS = ("datasets", "format_reward")


class ReasoningGymUnavailable(ImportError):
    """The reasoning-gym package is not installed."""


def _rg() -> Any:
    try:
        # lazy: the optional extra, imported only when this env is used
        import reasoning_gym
    except ImportError as e:
        raise ReasoningGymUnavailable(f"env=reasoning_gym needs the {PACKAGE} package, which is not installed "
                                      f"({e}); install it with: {INSTALL}") from None
    return reasoning_gym


def extract_answer(text: str) -> Optional[str]:
    """The text inside the last <answer>...</answer> (stripped), or None."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


def format_reward_option(options: dict[str, Any]) -> float:
    """env.options.format_reward: what a training reply with answer tags that the verifier scores 0 earns."""
    value = options.get("format_reward", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"env.options.format_reward={value!r}: expected a number in [0, 1) (a correct answer earns 1.0)")
    return float(value)


def task_specs(options: dict[str, Any]) -> list[tuple[str, float, dict[str, Any]]]:
    """`env.options` -> [(task, weight, config)], each name checked against reasoning-gym's registry and each
    config against the task's config class (a ValueError naming the entry)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options: reasoning_gym does not know {unknown}; it understands {list(OPTIONS)}")
    entries = options.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"env.options.datasets must be a non-empty list of task names or {{name, weight, config}} "
                         f"entries, got {entries!r}")
    registered = _registered_tasks()
    specs = []
    for i, entry in enumerate(entries):
        where = f"env.options.datasets[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{where}: expected a task name or a mapping with name, got {entry!r}")
        extra = sorted(set(entry) - {"name", "weight", "config"})
        if extra:
            raise ValueError(f"{where}: unknown keys {extra}; valid: name, weight, config")
        name, weight, config = entry["name"], entry.get("weight", 1.0), dict(entry.get("config") or {})
        if name not in registered:
            close = difflib.get_close_matches(name, registered, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: reasoning-gym has no task {name!r}{hint}; it has {len(registered)}, "
                             f"e.g. {', '.join(registered[:8])}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}: weight must be a number > 0, got {weight!r}")
        if {"seed", "size"} & set(config):
            raise ValueError(f"{where}: config must not set seed or size (env.seed, env.num_train and "
                             "env.num_val decide them)")
        try:
            _dataset(name, json.dumps(config, sort_keys=True), 0, 1)
        except Exception as e:
            raise ValueError(f"{where}: task {name!r} refuses config {config}: {type(e).__name__}: {e}") from None
        specs.append((name, float(weight), config))
    return specs


def _registered_tasks() -> list[str]:
    _rg()
    # lazy: the optional extra (present: _rg() checked)
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    return _rg().create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def _dataset_of(ref: dict[str, Any]) -> Any:
    """The reasoning-gym dataset a row's entry comes from (extra_info.reasoning_gym)."""
    return _dataset(ref["task"], ref["config"], int(ref["seed"]), int(ref["size"]))


def _entry(ref: dict[str, Any]) -> dict[str, Any]:
    """The reasoning-gym entry a row names (extra_info.reasoning_gym), regenerated."""
    return _dataset_of(ref)[int(ref["index"])]


def generate(cfg: EnvConfig, split: str, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """`cfg.num_train` or `cfg.num_val` rows of `split`, skipping questions in `exclude`."""
    _rg()
    specs = task_specs(dict(cfg.options))
    fmt = format_reward_option(dict(cfg.options)) if split == "train" else 0.0  # evaluation scores correctness only
    n = cfg.num_train if split == "train" else cfg.num_val
    size = 2 * n + 64  # room for the entries skipped as val questions
    rng = random.Random(derive_seed(cfg.seed, SPLIT_IDS[split]))
    # per entry k of the list (one task may appear twice, with two configs): its seed, config and next index
    taken = [0] * len(specs)
    seeds = [derive_seed(cfg.seed, SPLIT_IDS[split], k) % 2**32 for k in range(len(specs))]
    configs = [json.dumps(config, sort_keys=True) for _, _, config in specs]
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        k = rng.choices(range(len(specs)), weights=[s[1] for s in specs])[0]
        name = specs[k][0]
        ref = {"task": name, "config": configs[k], "seed": seeds[k], "size": size, "index": taken[k]}
        taken[k] += 1
        if taken[k] > size:
            raise ValueError(f"reasoning_gym task {name!r}: cannot draw {n} {split} rows whose questions are not "
                             f"in the val split (its config allows too few distinct problems)")
        entry = _entry(ref)
        if entry["question"] in exclude:
            continue
        rows.append(to_row(entry, ref, split, len(rows), fmt))
    return rows


def to_row(entry: dict[str, Any], ref: dict[str, Any], split: str, index: int,
           format_reward: float = 0.0) -> dict[str, Any]:
    row = {
        "data_source": DATA_SOURCE_PREFIX + ref["task"],
        "prompt": [{"role": "user", "content": entry["question"] + INSTRUCTION}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {"split": split, "index": index, "question": entry["question"], "reasoning_gym": dict(ref)},
    }
    if format_reward:
        row["extra_info"]["format_reward"] = format_reward
    return row


def score(final_text: str, extra_info: dict[str, Any]) -> dict[str, float]:
    """The task's own verifier on the last <answer> of the reply."""
    ref = (extra_info or {}).get("reasoning_gym")
    if not isinstance(ref, dict):
        raise ValueError("a reasoning_gym row needs extra_info.reasoning_gym (the entry it was generated from)")
    answer = extract_answer(final_text)
    value = float(_dataset_of(ref).score_answer(answer, _entry(ref)))
    shaped = value if value > 0 or answer is None else float(extra_info.get("format_reward", 0.0))
    return {"score": shaped, "correct": float(value == 1.0), "formatted": float(answer is not None)}


@register("env", "reasoning_gym")
class ReasoningGymEnv(Env):
    """reasoning-gym's procedurally generated tasks (asyncrl data reasoning_gym --out DIR)."""

    name = "reasoning_gym"

    def build(self, cfg: EnvConfig, split: str) -> list[dict[str, Any]]:
        if split not in SPLIT_IDS:
            raise ValueError(f"reasoning_gym: unknown split {split!r}; expected train or val")
        val = generate(cfg, "val")
        if split == "val":
            return val
        return generate(cfg, "train", exclude=frozenset(r["extra_info"]["question"] for r in val))

    def reward(self, *, final_text: str, ground_truth: Any, extra_info: dict[str, Any],
               tool_rewards: list[float], turn_rewards: list[float]) -> dict[str, float]:
        return score(final_text, extra_info)

    def demo_turns(self, row: dict[str, Any]) -> list[Any]:
        """The task's own answer in tags, in one turn: what the warm start teaches (the answer format)."""
        answer = (row.get("reward_model") or {}).get("ground_truth")
        if answer is None or not isinstance((row.get("extra_info") or {}).get("reasoning_gym"), dict):
            raise DemoError("the row has no ground truth or no extra_info.reasoning_gym: nothing to demonstrate")
        return [DemoTurn(f"<answer>{answer}</answer>")]

    @staticmethod
    def add_data_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
        parser.add_argument("--num-train", type=int, default=2048)
        parser.add_argument("--num-val", type=int, default=64)
        parser.add_argument("--seed", type=int, default=0)

    def data_command(self, args: argparse.Namespace) -> int:
        cfg = load_config(["env=reasoning_gym", f"env.num_train={args.num_train}", f"env.num_val={args.num_val}",
                           f"env.seed={args.seed}"])
        out = Path(args.out)
        written = {split: {"path": str(write_rows(self.build(cfg.env, split), out / f"{split}.parquet"))}
                   for split in ("train", "val")}
        print(json.dumps(written))
        return 0
