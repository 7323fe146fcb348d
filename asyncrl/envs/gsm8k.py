"""env `gsm8k`: grade-school math in verl's row schema, from the user's own copy of GSM8K.

Nothing is downloaded. `asyncrl data gsm8k --input FILE --out DIR [--split train]` converts the
public GSM8K jsonl or parquet (fields `question`, `answer`, the answer ending in "#### n") into
DIR/<split>.parquet; `--agent-name`, `--tools-kwargs JSON`, `--interaction-kwargs JSON` and
`--method strict|flexible` are stamped onto every row. `build()` reads cfg.train_file / cfg.val_file.

Answer format: the reply ends with "#### N". Reward (verl's gsm8k rule, 1.0 / 0.0):
  - strict (default): the number after the last "####" must equal the ground truth;
  - flexible: the last number anywhere in the reply must equal it.
Numbers compare numerically after removing "$" and thousands commas ("1,000" == "1000.0").
The method comes from the row's extra_info.reward_method, else "strict". The registered rewards
`gsm8k_strict` and `gsm8k_flexible` force one (env.reward.name=gsm8k_flexible).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asyncrl.config import EnvConfig
from asyncrl.data.rows import DataError, load_file, read_rows, write_rows
from asyncrl.envs.base import Env
from asyncrl.registry import register

from .rewards import extract_gsm8k, numbers_equal, parse_number

DATA_SOURCE = "openai/gsm8k"
METHODS = ("strict", "flexible")
INSTRUCTION = ("Solve the problem step by step. You may call the calculator tool. "
               "Write the final answer after \"####\", as in \"#### 42\".\n\n")


def compute_score(final_text: str, ground_truth: Any, method: str = "strict") -> float:
    """1.0 if the answer extracted by `method` (strict | flexible) equals ground_truth numerically."""
    if method not in METHODS:
        raise ValueError(f"gsm8k reward method {method!r} is not one of {', '.join(METHODS)}")
    return 1.0 if numbers_equal(extract_gsm8k(final_text, method), ground_truth) else 0.0


def gold_from_solution(answer: str, where: str) -> str:
    """The number after "####" in a GSM8K reference solution, commas removed ("1,000" -> "1000")."""
    gold = extract_gsm8k(str(answer), "strict")
    if gold is None:
        raise ValueError(f"{where}: the answer has no '#### n' line: {str(answer)[-80:]!r}")
    return str(gold).replace(",", "").replace("$", "").replace(" ", "").rstrip(".")


def convert(records: list[dict[str, Any]], *, split: str, source: str = "input",
            agent_name: str | None = None, tools_kwargs: dict | None = None,
            interaction_kwargs: dict | None = None, method: str | None = None) -> list[dict[str, Any]]:
    """GSM8K records {question, answer} -> verl rows. Raises ValueError naming the record at fault."""
    rows = []
    for i, rec in enumerate(records):
        where = f"{source} record {i}"
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a mapping with question and answer, got {type(rec).__name__}")
        for key in ("question", "answer"):
            if not isinstance(rec.get(key), str) or not rec[key].strip():
                raise ValueError(f"{where}: field {key!r} is missing or not a non-empty string")
        gold = gold_from_solution(rec["answer"], where)
        extra: dict[str, Any] = {"split": split, "index": i, "question": rec["question"], "answer": rec["answer"]}
        if method:
            extra["reward_method"] = method
        if tools_kwargs:
            extra["tools_kwargs"] = tools_kwargs
        if interaction_kwargs:
            extra["interaction_kwargs"] = interaction_kwargs
        row = {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": INSTRUCTION + rec["question"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gold},
            "extra_info": extra,
        }
        if agent_name:
            row["agent_name"] = agent_name
        rows.append(row)
    return rows


def _json_mapping(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"asyncrl data gsm8k: {flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"asyncrl data gsm8k: {flag} must be a JSON object, got {type(value).__name__}")
    return value


@register("env", "gsm8k")
class GSM8KEnv(Env):
    """GSM8K from your own copy (asyncrl data gsm8k --input FILE --out DIR)."""

    name = "gsm8k"

    def build(self, cfg: EnvConfig, split: str) -> list[dict[str, Any]]:
        path = cfg.train_file if split == "train" else cfg.val_file
        if not path:
            raise ValueError(f"env gsm8k needs env.{'train' if split == 'train' else 'val'}_file: convert your GSM8K "
                             "copy with `asyncrl data gsm8k --input FILE --out DIR` and point at DIR/train.parquet")
        return read_rows(path, skip_bad=cfg.skip_bad_rows)

    def reward(self, *, final_text: str, ground_truth: Any, extra_info: dict[str, Any],
               tool_rewards: list[float], turn_rewards: list[float]) -> float:
        method = (extra_info or {}).get("reward_method") or "strict"
        return compute_score(final_text, ground_truth, method)

    @staticmethod
    def add_data_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--input", required=True, help="GSM8K jsonl or parquet with question/answer fields")
        parser.add_argument("--out", required=True, help="output directory (writes <split>.parquet)")
        parser.add_argument("--split", default="train", help="split name for the file and extra_info (default: train)")
        parser.add_argument("--limit", type=int, default=None, help="keep only the first N records")
        parser.add_argument("--agent-name", default=None, help="agent_name column for every row")
        parser.add_argument("--tools-kwargs", default=None, help='JSON, e.g. {"calculator": {"create_kwargs": {}}}')
        parser.add_argument("--interaction-kwargs", default=None, help='JSON, e.g. {"name": "gsm8k"}')
        parser.add_argument("--method", choices=METHODS, default=None, help="answer extraction for the reward")

    def data_command(self, args: argparse.Namespace) -> int:
        try:
            records = load_file(args.input)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if args.limit is not None:
            records = records[: args.limit]
        tk = _json_mapping(args.tools_kwargs, "--tools-kwargs") if args.tools_kwargs else None
        ik = _json_mapping(args.interaction_kwargs, "--interaction-kwargs") if args.interaction_kwargs else None
        try:
            rows = convert(records, split=args.split, source=str(args.input), agent_name=args.agent_name,
                           tools_kwargs=tk, interaction_kwargs=ik, method=args.method)
            path = write_rows(rows, Path(args.out) / f"{args.split}.parquet")
        except (ValueError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"path": str(path), "rows": len(rows)}))
        return 0


@register("reward", "gsm8k_strict")
def gsm8k_strict(*, final_text: str, ground_truth: Any, **_: Any) -> float:
    """GSM8K reward with strict '#### n' extraction, whatever the row says."""
    return compute_score(final_text, ground_truth, "strict")


@register("reward", "gsm8k_flexible")
def gsm8k_flexible(*, final_text: str, ground_truth: Any, **_: Any) -> float:
    """GSM8K reward with flexible (last number) extraction, whatever the row says."""
    return compute_score(final_text, ground_truth, "flexible")


__all__ = ["GSM8KEnv", "compute_score", "convert", "gold_from_solution", "parse_number"]
