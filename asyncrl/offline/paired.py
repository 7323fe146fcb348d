"""Two evals of the same episodes, compared episode by episode: did the second model gain?

`asyncrl eval` fixes every episode's sampling seed by (--seed, row, sample), so two evals of different
models with the same split, -k, --seed and --limit run the same prompts under the same seeds. Pairing their
episodes by (data_index, sample_index, seed) removes the prompts' own spread from the difference: what is
left is the episodes that changed, `up` (failed under A, succeeded under B) and `down` (the reverse).

The test is the exact two-sided sign test on the changed episodes: under "B is no better or worse than A"
each change is up or down with probability 1/2, so p = P(|X - n/2| >= |up - n/2|) for X ~ Binomial(n, 1/2),
n = up + down (1.0 when nothing changed). Episodes of one prompt are not independent, so the test is a
guide, not a proof; it is the test the README reports for the default run's RL share.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Key = tuple[int, int, int]


def sign_test_p(up: int, down: int) -> float:
    """Exact two-sided sign test p-value for `up` successes in `up + down` fair coin flips."""
    if up < 0 or down < 0:
        raise ValueError(f"counts must be >= 0, got up={up} down={down}")
    n = up + down
    if n == 0:
        return 1.0
    k = min(up, down)
    # P(X <= k) for X ~ Binomial(n, 1/2), doubled (the distribution is symmetric), capped at 1
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def _by_key(records: Iterable[dict[str, Any]], name: str) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for r in records:
        key = (int(r["data_index"]), int(r["sample_index"]), int(r["seed"]))
        if key in out:
            raise ValueError(f"{name}: episode (data_index, sample_index, seed) = {key} appears twice")
        out[key] = r
    return out


def compare(base: Iterable[dict[str, Any]], new: Iterable[dict[str, Any]], threshold: float = 1.0,
            base_name: str = "A", new_name: str = "B") -> dict[str, Any]:
    """Pair the episodes of two evals (records as `asyncrl eval` writes them to episodes.jsonl) and count
    the changes; both must hold exactly the same episodes (else ValueError naming the first difference).
    A failed episode (error) counts as reward 0, as in the eval's own scores."""
    a, b = _by_key(base, base_name), _by_key(new, new_name)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        which = f"{len(only_a)} only in {base_name} (e.g. {only_a[0]})" if only_a else ""
        which += ("; " if which else "") + (f"{len(only_b)} only in {new_name} (e.g. {only_b[0]})" if only_b else "")
        raise ValueError(f"the evals did not run the same episodes (data_index, sample_index, seed): {which}; "
                         f"run both with the same split, -k, --seed and --limit")
    if not a:
        raise ValueError("no episodes to compare")

    def ok(r: dict[str, Any]) -> bool:
        return not r.get("error") and float(r["reward"]) >= threshold

    up = sum(1 for k in a if not ok(a[k]) and ok(b[k]))
    down = sum(1 for k in a if ok(a[k]) and not ok(b[k]))
    n = len(a)
    base_ok, new_ok = sum(ok(r) for r in a.values()), sum(ok(r) for r in b.values())
    return {"episodes": n, "threshold": threshold, "base_success": round(base_ok / n, 4),
            "new_success": round(new_ok / n, 4), "up": up, "down": down, "unchanged": n - up - down,
            "sign_test_p": float(f"{sign_test_p(up, down):.3g}")}  # 3 significant digits: 1.18e-08 is not 0


def read_episodes(eval_dir: str | Path) -> list[dict[str, Any]]:
    """The records of an eval's episodes.jsonl (ValueError naming the file when it is missing or bad)."""
    path = Path(eval_dir) / "episodes.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: give the --out dir of an earlier `asyncrl eval`")
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                for field in ("data_index", "sample_index", "seed", "reward"):
                    if field not in rec:
                        raise ValueError(f"no {field!r}")
                if not math.isfinite(float(rec["reward"])):
                    raise ValueError(f"reward {rec['reward']!r} is not finite")
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not an eval episode record ({e})") from None
            out.append(rec)
    return out


def describe(result: dict[str, Any], base_name: str, new_name: str) -> str:
    """One line for a person: success rates, the changed episodes and the sign test."""
    p = result["sign_test_p"]
    verdict = "significant at 0.05" if p < 0.05 else "not significant at 0.05"
    return (f"{new_name} vs {base_name}: success {result['base_success']:.1%} -> {result['new_success']:.1%} over "
            f"{result['episodes']} paired episodes; {result['up']} up, {result['down']} down; "
            f"sign test p = {p:.3g} ({verdict})")


def against(base: list[dict[str, Any]], new: list[dict[str, Any]], threshold: float, base_dir: str,
            new_name: str) -> tuple[dict[str, Any], str]:
    """`asyncrl eval --against`'s block of summary.json and its line: the comparison, or the reason there
    is none (episodes that do not pair), which leaves the eval's own scores standing."""
    try:
        result = compare(base, new, threshold, base_dir, new_name)
    except ValueError as e:
        return {"eval_dir": base_dir, "error": str(e)}, f"--against {base_dir}: no comparison: {e}"
    return {"eval_dir": base_dir, **result}, describe(result, base_dir, new_name)
