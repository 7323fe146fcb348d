"""The numbers an evaluation reports, as pure functions of its episodes.

An episode succeeds when its reward is >= the success threshold (1.0 by default: the built-in envs pay
exactly 1.0 for a correct, well-formatted answer). With n samples of a prompt, c of them successes:

    pass@k  = 1 - C(n - c, k) / C(n, k)        (the unbiased estimator of Chen et al. 2021, "Evaluating
                                                 Large Language Models Trained on Code", eq. 1; k <= n)
    pass@1  = c / n                            (its k = 1 case)
    mean@k  = mean of the n rewards            (the expected reward of one sample)

each averaged over prompts (every prompt weighs the same, whatever its number of samples). With k = n,
pass@k is the fraction of prompts with at least one success. An episode that failed to run (engine error,
agent bug) counts as reward 0 and is counted in `failed_episodes`: it is never silently left out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, is correct)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(episodes: Iterable[dict[str, Any]], k: int, threshold: float = 1.0) -> dict[str, Any]:
    """Scores of `episodes` (dicts with data_index, reward, metrics, error, data_source), overall and per
    data source. Every prompt must have at least `k` samples."""
    episodes = list(episodes)
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in episodes:
        by_source[str(e.get("data_source") or "")].append(e)
    out = _scores(episodes, k, threshold)
    if len(by_source) > 1 or (by_source and "" not in by_source):
        out["by_source"] = {src: _scores(eps, k, threshold) for src, eps in sorted(by_source.items())}
    return out


def _scores(episodes: list[dict[str, Any]], k: int, threshold: float) -> dict[str, Any]:
    prompts: dict[int, list[float]] = defaultdict(list)
    for e in episodes:
        prompts[int(e["data_index"])].append(float(e["reward"]))
    short = {i: len(rs) for i, rs in prompts.items() if len(rs) < k}
    if short:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt; prompts with fewer (data_index: "
                         f"samples): {dict(list(short.items())[:5])}")
    rewards = [float(e["reward"]) for e in episodes]
    out: dict[str, Any] = {
        "num_prompts": len(prompts),
        "num_episodes": len(episodes),
        "failed_episodes": sum(1 for e in episodes if e.get("error")),
        f"mean@{k}": _mean(rewards),
        "pass@1": _mean([pass_at_k(len(rs), sum(r >= threshold for r in rs), 1) for rs in prompts.values()]),
        f"pass@{k}": _mean([pass_at_k(len(rs), sum(r >= threshold for r in rs), k) for rs in prompts.values()]),
        "tool_call_rate": _mean([1.0 if (e.get("metrics") or {}).get("tool_calls", 0) > 0 else 0.0 for e in episodes]),
    }
    parts = sorted({m for e in episodes for m in (e.get("metrics") or {}) if m.startswith("reward/")})
    for m in parts:  # the env's reward parts (reward/correct, reward/formatted, ...), averaged over episodes
        vals = [float(e["metrics"][m]) for e in episodes if m in (e.get("metrics") or {})]
        out[m] = _mean(vals)
    return out
