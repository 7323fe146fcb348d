"""env `search_r1`: Search-R1-style retrieval QA over a synthetic, fictional multi-hop corpus.

The model searches with the `search` tool and ends with `<answer> ... </answer>`. Reward: the last
<answer>'s content against ground_truth.target after SQuAD normalization (lower case, no
punctuation, no articles, squeezed spaces):
  - "em" (default): exact match -> 1.0 / 0.0;
  - "substring": a gold answer occurs inside the prediction -> 1.0 / 0.0.
The row's extra_info.reward_method picks one; registered rewards `search_r1_em` and
`search_r1_substring` force one. The reward dict also reports both as metrics `em`, `substring_em`.

Data: `build()` generates rows from cfg.seed / num_train / num_val (see corpus.py);
`asyncrl data search_r1 --out DIR` writes corpus.jsonl, train.parquet and val.parquet.

Services: unless env.retriever.url is set, `services(cfg)` starts the retrieval server as a child
process on loopback over env.retriever.corpus, else the corpus.jsonl next to env.train_file, else
the generated corpus of this cfg (written to a temporary directory), and yields
{"search": {"retrieval_service_url": "<url>/retrieve", "topk": env.retriever.topk}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.config import EnvConfig
from asyncrl.data.rows import write_rows
from asyncrl.envs.base import DemoCall, DemoError, DemoTurn, Env
from asyncrl.registry import register

from ..rewards import em, extract_answer_tag, substring_em
from .corpus import Question, make_world, split_questions, write_corpus
from .launcher import start_retriever

DATA_SOURCE = "search_r1"
METHODS = ("em", "substring")
INSTRUCTION = (
    "Answer the given question. The question is about fictional people, companies and places, so do "
    "not guess: call the search tool to look facts up in the knowledge base, as many times as you need "
    "(one search per fact). When you know the answer, give it inside <answer> and </answer> without "
    "explanation, for example <answer> Paris </answer>.\n\nQuestion: "
)


def compute_score(final_text: str, ground_truth: Any, method: str = "em") -> dict[str, float]:
    """{"score", "em", "substring_em"} for the last <answer> in `final_text`; score follows `method`."""
    if method not in METHODS:
        raise ValueError(f"search_r1 reward method {method!r} is not one of {', '.join(METHODS)}")
    pred = extract_answer_tag(final_text)
    e, s = float(em(pred, ground_truth)), float(substring_em(pred, ground_truth))
    return {"score": e if method == "em" else s, "em": e, "substring_em": s}


def to_row(q: Question, split: str, index: int) -> dict[str, Any]:
    gt = {"target": [q.answer]}
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": INSTRUCTION + q.question}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {
            "split": split,
            "index": index,
            "question": q.question,
            "kind": q.kind,
            "hops": list(q.hops),
            "tools_kwargs": {"search": {"create_kwargs": {"ground_truth": gt, "question": q.question,
                                                          "data_source": DATA_SOURCE}}},
        },
    }


def generate(cfg: EnvConfig) -> tuple[list[dict[str, str]], dict[str, list[dict[str, Any]]]]:
    """(corpus documents, {"train": rows, "val": rows}) for cfg.seed / num_train / num_val."""
    world = make_world(cfg.seed, cfg.num_train + cfg.num_val)
    splits = split_questions(world, cfg.seed, cfg.num_train, cfg.num_val)
    rows = {s: [to_row(q, s, i) for i, q in enumerate(qs)] for s, qs in splits.items()}
    return world.documents(), rows


def corpus_for(cfg: EnvConfig) -> Path | None:
    """The corpus the run should serve: retriever.corpus, else corpus.jsonl beside train_file, else None
    (meaning: the generated one). A train_file without a corpus is an error (its answers are unknown)."""
    if cfg.retriever.corpus:
        p = Path(cfg.retriever.corpus).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"env.retriever.corpus={cfg.retriever.corpus!r} not found (resolved to {p.resolve()})")
        return p
    if cfg.train_file:
        p = Path(cfg.train_file).expanduser().parent / "corpus.jsonl"
        if p.is_file():
            return p
        raise FileNotFoundError(f"env.train_file={cfg.train_file!r} is set but no corpus: set env.retriever.corpus "
                                f"(looked for {p}) or env.retriever.url")
    return None


@register("env", "search_r1")
class SearchR1Env(Env):
    """Search-R1-style multi-hop QA over a synthetic corpus (asyncrl data search_r1 --out DIR)."""

    name = "search_r1"

    def build(self, cfg: EnvConfig, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "val"):
            raise ValueError(f"search_r1: unknown split {split!r}; expected train or val")
        return generate(cfg)[1][split]

    def reward(self, *, final_text: str, ground_truth: Any, extra_info: dict[str, Any],
               tool_rewards: list[float], turn_rewards: list[float]) -> dict[str, float]:
        return compute_score(final_text, ground_truth, (extra_info or {}).get("reward_method") or "em")

    def demo_turns(self, row: dict[str, Any]) -> list[Any]:
        """One search per hop (the title of each document the answer needs, in order), then the answer."""
        hops = (row.get("extra_info") or {}).get("hops")
        target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
        if not hops or not target:
            raise DemoError("the row has no extra_info.hops or no ground_truth.target: nothing to demonstrate")
        turns = [DemoTurn(f"I need to look up {h}." if k == 0 else f"Next I need to look up {h}.",
                          [DemoCall("search", {"query": str(h)})]) for k, h in enumerate(hops)]
        return turns + [DemoTurn(f"<answer> {target[0]} </answer>")]

    def check_demo(self, row: dict[str, Any], messages: list[dict[str, Any]]) -> str | None:
        """Each search must have found its hop's document (a right answer after a miss teaches guessing)."""
        hops = (row.get("extra_info") or {}).get("hops") or []
        results = [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]
        missed = [h for h, r in zip(hops, results) if str(h) not in r]
        if len(results) != len(hops) or missed:
            return f"the retriever did not return the document of hop(s) {missed or hops} for their search"
        return None

    @contextlib.contextmanager
    def services(self, cfg: EnvConfig) -> Iterator[dict[str, Any]]:
        r = cfg.retriever
        if r.url:
            base = r.url.rstrip("/")
            url = base if base.endswith("/retrieve") else base + "/retrieve"
            yield {"search": {"retrieval_service_url": url, "topk": r.topk}}
            return
        with tempfile.TemporaryDirectory(prefix="asyncrl-search_r1-") as tmp:
            corpus = corpus_for(cfg) or write_corpus(generate(cfg)[0], Path(tmp) / "corpus.jsonl")
            with start_retriever(corpus, method=r.method, log_dir=tmp) as proc:
                yield {"search": {"retrieval_service_url": proc.retrieve_url, "topk": r.topk}}

    @staticmethod
    def add_data_arguments(parser: argparse.ArgumentParser) -> None:
        d = EnvConfig()
        parser.add_argument("--out", required=True, help="directory for corpus.jsonl, train.parquet, val.parquet")
        parser.add_argument("--num-train", type=int, default=1024)
        parser.add_argument("--num-val", type=int, default=d.num_val)
        parser.add_argument("--seed", type=int, default=d.seed)

    def data_command(self, args: argparse.Namespace) -> int:
        cfg = replace(EnvConfig(), num_train=args.num_train, num_val=args.num_val, seed=args.seed)
        docs, rows = generate(cfg)
        out = Path(args.out)
        written = {"corpus": {"path": str(write_corpus(docs, out / "corpus.jsonl")), "documents": len(docs)}}
        for split in ("train", "val"):
            written[split] = {"path": str(write_rows(rows[split], out / f"{split}.parquet")), "rows": len(rows[split])}
        print(json.dumps(written))
        return 0


@register("reward", "search_r1_em")
def search_r1_em(*, final_text: str, ground_truth: Any, **_: Any) -> dict[str, float]:
    """Search-R1 exact match of the last <answer> (SQuAD normalization), whatever the row says."""
    return compute_score(final_text, ground_truth, "em")


@register("reward", "search_r1_substring")
def search_r1_substring(*, final_text: str, ground_truth: Any, **_: Any) -> dict[str, float]:
    """Search-R1 substring match of the last <answer> (SQuAD normalization), whatever the row says."""
    return compute_score(final_text, ground_truth, "substring")
