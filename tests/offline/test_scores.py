"""The evaluation's numbers against values counted by hand (asyncrl/offline/scores.py)."""

from __future__ import annotations

import math

import pytest

from asyncrl.offline.scores import pass_at_k, summarize


def _eps(rewards_by_prompt, source="s", **extra):
    return [{"data_index": i, "reward": r, "data_source": source, "metrics": extra.get("metrics", {}), "error": ""}
            for i, rs in rewards_by_prompt.items() for r in rs]


def test_pass_at_k_matches_counting_every_draw():
    # n=4 samples, c=2 correct: of the C(4,2)=6 pairs, only the one of the two wrong ones has no success
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 2, 3) == 1.0  # any 3 of 4 include a correct one
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_summary_by_hand():
    # prompt 0: 2 of 4 succeed; prompt 1: none; prompt 2: all; rewards below 1.0 are failures
    eps = _eps({0: [1.0, 0.5, 0.0, 1.0], 1: [0.9, 0.0, 0.0, 0.1], 2: [1.0, 1.0, 1.0, 1.0]})
    s = summarize(eps, k=4)
    assert s["num_prompts"] == 3 and s["num_episodes"] == 12 and s["failed_episodes"] == 0
    assert s["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert s["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert s["mean@4"] == pytest.approx(sum(e["reward"] for e in eps) / 12)
    assert "by_source" in s and s["by_source"]["s"]["pass@4"] == s["pass@4"]
    assert summarize(eps, k=2)["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert summarize(eps, k=4, threshold=0.5)["pass@1"] == pytest.approx((0.75 + 0.25 + 1) / 3)


def test_summary_per_source_and_parts_and_failures():
    a = _eps({0: [1.0, 0.0]}, source="a", metrics={"reward/correct": 1.0, "tool_calls": 1})
    b = _eps({1: [0.0, 0.0]}, source="b", metrics={"reward/correct": 0.0})
    b[1]["error"] = "EngineRequestError: down"
    s = summarize(a + b, k=2)
    assert s["failed_episodes"] == 1 and s["by_source"]["b"]["failed_episodes"] == 1
    assert s["by_source"]["a"]["pass@2"] == 1.0 and s["by_source"]["b"]["pass@2"] == 0.0
    assert s["tool_call_rate"] == 0.5 and s["reward/correct"] == 0.5


def test_summary_refuses_prompts_with_fewer_than_k_samples():
    with pytest.raises(ValueError, match="at least 3 samples"):
        summarize(_eps({0: [1.0, 0.0, 1.0], 7: [1.0]}), k=3)
