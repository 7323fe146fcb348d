"""env `arithmetic` (the default): seeded multi-step arithmetic word problems, solved with the calculator.

Answer format: the prompt asks for a last line `Answer: N` (N an integer). The reward is an exact
numeric match of the last stated answer ("Answer: N", or "the answer is N") with the ground truth:
1.0 or 0.0 ("Answer: 1,234", "answer: 1234.0", "the answer is $1234" all match 1234).
`env.options.format_reward=F` (in [0, 1)) gives F to a training reply that states an answer that
is wrong; the default
config sets 0.1, because the untrained 135M default model almost never answers correctly and a
group of all-zero rewards carries no GRPO signal. Validation rows never carry it.

Difficulty levels (cfg.difficulty, a list; rows cycle through it):
  1: two operands, one step:        a + b, a - b, a * k
  2: three operands, two steps:     (a + b) - c, a + b * c, ...
  3: four operands with parentheses: ((a + b) * k) - c, (a - b) * k + c, ...
  4: five operands, four steps, parentheses and (when the total divides) an exact division.
Numbers stay small (start 2..20, additions 1..15, factors 2..4) so a 135M model with a calculator
sometimes gets them right. Every problem's expression is kept in extra_info.expression.

Train and val are disjoint (no val problem text appears in train) and each is a pure function of
(cfg.seed, split, count, difficulty).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from asyncrl.agents.tool_calls import ToolCall, resolve_parser
from asyncrl.config import EnvConfig
from asyncrl.data.rows import write_rows
from asyncrl.envs.base import DemoCall, DemoError, DemoTurn, Env
from asyncrl.registry import register

from .rewards import extract_tagged_answer, numbers_equal, parse_number

DATA_SOURCE = "arithmetic"
MAX_LEVEL = 4

INSTRUCTION = (
    "Solve the problem. You can call the calculator tool, for example\n"
    "{example}\n"
    "Finish with a last line \"Answer: N\", for example \"Answer: 23\".\n\n"
)
OPTIONS = ("format_reward",)  # env.options this env understands

_NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Eli", "Ivy", "Max", "Nia", "Omar", "Ruby", "Tom"]
_ITEMS = ["apples", "marbles", "stickers", "coins", "books", "pencils", "shells", "stamps", "cards", "eggs"]


@dataclass
class _State:
    value: int
    expr: str
    low_prec: bool  # the expression's top operator is + or - (needs parentheses before * or /)


def _step(rng: random.Random, st: _State, who: str, items: str, kinds: list[str]) -> tuple[str, _State]:
    """One sentence and the new state, of a kind drawn from `kinds`; values stay positive integers."""
    kind = rng.choice(kinds)
    if kind == "sub" and st.value < 2:
        kind = "add"
    divisors = [k for k in (2, 3, 4, 5) if st.value % k == 0]
    if kind == "share" and not divisors:
        kind = "mul"
    wrap = f"({st.expr})" if st.low_prec else st.expr
    if kind == "add":
        b = rng.randint(1, 15)
        text = rng.choice([f"{who} gets {b} more {items}.", f"{who} finds {b} more {items}.",
                           f"A friend gives {who} {b} {items}."])
        return text, _State(st.value + b, f"{st.expr} + {b}", True)
    if kind == "sub":
        b = rng.randint(1, min(15, st.value - 1))
        text = rng.choice([f"{who} gives away {b} {items}.", f"{who} loses {b} {items}.",
                           f"{who} uses {b} of the {items}."])
        return text, _State(st.value - b, f"{st.expr} - {b}", True)
    if kind == "mul":
        k = rng.randint(2, 4)
        word = {2: "doubles", 3: "triples", 4: "quadruples"}[k]
        text = f"Then the number of {items} {who} has {word} (it becomes {k} times as many)."
        return text, _State(st.value * k, f"{wrap} * {k}", False)
    k = rng.choice(divisors)
    text = f"{who} shares all the {items} equally among {k} friends."
    return text, _State(st.value // k, f"{wrap} / {k}", False)


def make_problem(rng: random.Random, level: int) -> dict[str, Any]:
    """One problem of `level`: {question, answer (int), expression, difficulty}.

    Levels >= 3 start with an addition or subtraction followed by a multiplication, so the
    expression has parentheses; level 4 ends with an exact division when the total divides."""
    if not 1 <= level <= MAX_LEVEL:
        raise ValueError(f"arithmetic difficulty {level} is not in 1..{MAX_LEVEL} (env.difficulty)")
    who, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(2, 20)
    st = _State(a, str(a), False)
    sentences = [f"{who} has {a} {items}."]
    steps = level
    if level == 2 and rng.random() < 0.5:  # a grouped purchase: three operands in one step
        b, c = rng.randint(2, 5), rng.randint(2, 6)
        sentences.append(f"{who} buys {b} bags with {c} {items} in each bag.")
        st = _State(a + b * c, f"{a} + {b} * {c}", True)
        steps = 0
    for i in range(steps):
        if level >= 3 and i == 0:
            kinds = ["add", "sub"]
        elif level >= 3 and i == 1:
            kinds = ["mul"]
        elif level >= 4 and i == steps - 1:
            kinds = ["share"]
        elif level <= 2 and st.low_prec:
            kinds = ["add", "sub"]  # no parentheses below level 3
        else:
            kinds = ["add", "sub", "mul"]
        text, st = _step(rng, st, who, items, kinds)
        sentences.append(text)
    if " / " in st.expr:
        question = f"How many {items} does each friend get?"
    else:
        question = f"How many {items} does {who} have now?"
    return {"question": " ".join(sentences) + " " + question, "answer": st.value, "expression": st.expr,
            "difficulty": level}


def generate(seed: int, split: str, n: int, levels: list[int], exclude: set[str] = frozenset()) -> list[dict]:
    """`n` distinct problems for `split`, cycling through `levels`, skipping question texts in `exclude`."""
    for lv in levels:
        if not isinstance(lv, int) or not 1 <= lv <= MAX_LEVEL:
            raise ValueError(f"env.difficulty holds {lv!r}; levels are integers in 1..{MAX_LEVEL}")
    if not levels:
        raise ValueError("env.difficulty is empty; give at least one level in 1..4")
    rng = random.Random(f"asyncrl-arithmetic-{seed}-{split}")
    out, seen = [], set(exclude)
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"cannot generate {n} distinct arithmetic problems at levels {levels}")
        p = make_problem(rng, levels[len(out) % len(levels)])
        if p["question"] in seen:
            continue
        seen.add(p["question"])
        out.append(p)
    return out


@functools.cache
def instruction() -> str:
    """INSTRUCTION with its example call written by the hermes parser, which owns that format (the rows are
    data, built apart from any run: their example is hermes whatever agent.tool_parser reads the replies)."""
    return INSTRUCTION.format(example=resolve_parser("hermes").render("", [ToolCall("calculator", {"expression": "16 + 7"})]))


def to_row(p: dict[str, Any], split: str, index: int, format_reward: float = 0.0) -> dict[str, Any]:
    gt = str(p["answer"])
    row = {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": instruction() + p["question"]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {
            "split": split,
            "index": index,
            "difficulty": p["difficulty"],
            "expression": p["expression"],
            "question": p["question"],
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": gt}}},
        },
    }
    if format_reward:
        row["extra_info"]["format_reward"] = format_reward
    return row


def compute_score(final_text: str, ground_truth: Any) -> float:
    """1.0 if the number after the last "Answer:" equals ground_truth numerically, else 0.0."""
    return 1.0 if numbers_equal(extract_tagged_answer(final_text), ground_truth) else 0.0


def shaped_score(final_text: str, ground_truth: Any, format_reward: float = 0.0) -> dict[str, float]:
    """1.0 for the right number; `format_reward` for a wrong number stated as the answer;
    else 0.0. Also reports `correct` and `formatted` (0/1), which land in the metrics as reward/*."""
    answer = extract_tagged_answer(final_text)
    formatted = answer is not None and parse_number(answer) is not None
    correct = formatted and numbers_equal(answer, ground_truth)
    score = 1.0 if correct else (format_reward if formatted else 0.0)
    return {"score": score, "correct": float(correct), "formatted": float(formatted)}


def format_reward_option(options: dict[str, Any]) -> float:
    """Validate env.options for arithmetic; returns format_reward (default 0.0)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options: arithmetic does not know {unknown}; it understands {list(OPTIONS)}")
    value = options.get("format_reward", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"env.options.format_reward={value!r}: expected a number in [0, 1) "
                         "(a correct answer earns 1.0)")
    return float(value)


@register("env", "arithmetic")
class ArithmeticEnv(Env):
    """Seeded multi-step arithmetic word problems (asyncrl data arithmetic --out DIR)."""

    name = "arithmetic"

    def build(self, cfg: EnvConfig, split: str) -> list[dict[str, Any]]:
        fmt = format_reward_option(dict(cfg.options))
        levels = list(cfg.difficulty)
        val = generate(cfg.seed, "val", cfg.num_val, levels)
        if split == "val":  # evaluation scores correctness only
            return [to_row(p, "val", i) for i, p in enumerate(val)]
        if split != "train":
            raise ValueError(f"arithmetic: unknown split {split!r}; expected train or val")
        train = generate(cfg.seed, "train", cfg.num_train, levels, exclude={p["question"] for p in val})
        return [to_row(p, "train", i, format_reward=fmt) for i, p in enumerate(train)]

    def reward(self, *, final_text: str, ground_truth: Any, extra_info: dict[str, Any],
               tool_rewards: list[float], turn_rewards: list[float]) -> dict[str, float]:
        return shaped_score(final_text, ground_truth, float(extra_info.get("format_reward", 0.0)))

    def demo_turns(self, row: dict[str, Any]) -> list[Any]:
        """One calculator call with the problem's expression, then the stated answer."""
        expr = (row.get("extra_info") or {}).get("expression")
        answer = (row.get("reward_model") or {}).get("ground_truth")
        if not isinstance(expr, str) or not expr or answer is None:
            raise DemoError("the row has no extra_info.expression or no ground truth: nothing to demonstrate")
        return [DemoTurn("I will compute it with the calculator.", [DemoCall("calculator", {"expression": expr})]),
                DemoTurn(f"The calculator gives {answer}.\nAnswer: {answer}")]

    def check_demo(self, row: dict[str, Any], messages: list[dict[str, Any]]) -> str | None:
        """The calculator's result must be the ground truth (else the row's expression and answer disagree)."""
        answer = (row.get("reward_model") or {}).get("ground_truth")
        results = [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]
        if not results or not numbers_equal(results[-1].strip(), answer):
            return f"the calculator returned {results[-1][:50] if results else 'nothing'!r}, the ground truth is {answer!r}"
        return None

    # ------------------------------------------------------------------ asyncrl data arithmetic

    @staticmethod
    def add_data_arguments(parser: argparse.ArgumentParser) -> None:
        d = EnvConfig()
        parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
        parser.add_argument("--num-train", type=int, default=d.num_train)
        parser.add_argument("--num-val", type=int, default=d.num_val)
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--difficulty", type=int, nargs="+", default=d.difficulty,
                            help=f"levels in 1..{MAX_LEVEL} (default: %(default)s)")

    def data_command(self, args: argparse.Namespace) -> int:
        cfg = replace(EnvConfig(), num_train=args.num_train, num_val=args.num_val, seed=args.seed,
                      difficulty=list(args.difficulty))
        out = Path(args.out)
        written = {}
        for split in ("train", "val"):
            rows = self.build(cfg, split)
            written[split] = {"path": str(write_rows(rows, out / f"{split}.parquet")), "rows": len(rows)}
        print(json.dumps(written))
        return 0
