"""Reward functions against hand-checked tables."""

from __future__ import annotations

import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import arithmetic, gsm8k
from asyncrl.envs.rewards import extract_answer_tag, extract_gsm8k, normalize_answer, parse_number
from asyncrl.envs.search_r1 import env as search_r1

ARITHMETIC = [
    ("12 + 30 = 42\nAnswer: 42", "42", 1.0),
    ("Answer: 42", 42, 1.0),
    ("answer: 42.0", "42", 1.0),
    ("Answer: 1,234", "1234", 1.0),
    ("Answer: $7", "7", 1.0),
    ("Answer: -3", "-3", 1.0),
    ("Answer: 41\nWait, Answer: 42", "42", 1.0),  # the last one counts
    ("Answer: 42\nActually Answer: 41", "42", 0.0),
    ("The answer is 42.", "42", 1.0),  # a stated answer counts, not only the "Answer:" line
    ("So the answer is: **42**", "42", 1.0),
    ("The answer is 41, not 42", "42", 0.0),
    ("I will answer now: it is 42", "42", 0.0),  # no number right after "answer"
    ("function getAnswer(n) { return 42; }", "42", 0.0),
    ("42", "42", 0.0),
    ("Answer: 420", "42", 0.0),
    ("Answer: 4.2", "42", 0.0),
    ("Answer: forty-two", "42", 0.0),
    ("", "42", 0.0),
]


@pytest.mark.parametrize("text,gold,want", ARITHMETIC)
def test_arithmetic_reward_table(text, gold, want):
    env = arithmetic.ArithmeticEnv()
    got = env.reward(final_text=text, ground_truth=gold, extra_info={}, tool_rewards=[], turn_rewards=[])
    assert got["score"] == want and got["correct"] == want


@pytest.mark.parametrize("text,want_score,want_formatted", [
    ("Answer: 42", 1.0, 1.0),      # correct: 1.0, never the format reward on top
    ("Answer: 41", 0.25, 1.0),     # well formed but wrong: the format reward
    ("Answer: 4.2", 0.25, 1.0),
    ("The answer is 41", 0.25, 1.0),
    ("It is 41", 0.0, 0.0),
    ("Answer: forty-two", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_arithmetic_format_reward(text, want_score, want_formatted):
    env = arithmetic.ArithmeticEnv()
    got = env.reward(final_text=text, ground_truth="42", extra_info={"format_reward": 0.25}, tool_rewards=[],
                     turn_rewards=[])
    assert got == {"score": want_score, "correct": float(want_score == 1.0), "formatted": want_formatted}


def test_arithmetic_format_reward_reaches_train_rows_only_and_is_validated():
    env = arithmetic.ArithmeticEnv()
    cfg = EnvConfig(name="arithmetic", num_train=8, num_val=4, options={"format_reward": 0.1})
    assert all(r["extra_info"]["format_reward"] == 0.1 for r in env.build(cfg, "train"))
    assert all("format_reward" not in r["extra_info"] for r in env.build(cfg, "val"))
    for bad, match in [({"format_reward": 1.0}, "format_reward=1.0"), ({"format_reward": "x"}, "format_reward='x'"),
                       ({"fromat_reward": 0.1}, "fromat_reward")]:
        with pytest.raises(ValueError, match=match):
            env.build(EnvConfig(name="arithmetic", num_train=8, num_val=4, options=bad), "train")


GSM8K = [
    # text, gold, strict, flexible
    ("so 5 + 3 = 8\n#### 8", "8", 1.0, 1.0),
    ("#### 1,000", "1000", 1.0, 1.0),
    ("#### $18.", "18", 1.0, 1.0),
    ("#### 72.0", "72", 1.0, 1.0),
    ("#### 7 then #### 8", "8", 1.0, 1.0),
    ("#### 8 and 9 apples", "8", 1.0, 0.0),  # flexible takes the LAST number (9)
    ("The answer is 8.", "8", 0.0, 1.0),  # no ####: strict fails, flexible finds 8
    ("I have 3 and then 8", "8", 0.0, 1.0),
    ("8 first, finally 3", "8", 0.0, 0.0),
    ("####8", "8", 1.0, 1.0),
    ("#### -4", "-4", 1.0, 1.0),
    ("no numbers at all", "8", 0.0, 0.0),
    ("#### 80", "8", 0.0, 0.0),
]


@pytest.mark.parametrize("text,gold,strict,flexible", GSM8K)
def test_gsm8k_strict_and_flexible(text, gold, strict, flexible):
    assert gsm8k.compute_score(text, gold, "strict") == strict
    assert gsm8k.compute_score(text, gold, "flexible") == flexible
    env = gsm8k.GSM8KEnv()
    kw = dict(final_text=text, ground_truth=gold, tool_rewards=[], turn_rewards=[])
    assert env.reward(extra_info={}, **kw) == strict  # default method: strict
    assert env.reward(extra_info={"reward_method": "flexible"}, **kw) == flexible
    assert gsm8k.gsm8k_flexible(**kw) == flexible and gsm8k.gsm8k_strict(**kw) == strict


def test_gsm8k_bad_method_names_itself():
    with pytest.raises(ValueError, match="'loose'"):
        gsm8k.compute_score("#### 1", "1", "loose")


SEARCH = [
    # text, golds, em, substring
    ("<answer>Paris</answer>", ["Paris"], 1.0, 1.0),
    ("<answer> the  Paris. </answer>", ["Paris"], 1.0, 1.0),  # articles, punctuation, spaces
    ("<answer>PARIS</answer>", {"target": ["paris"]}, 1.0, 1.0),
    ("<answer>Paris, France</answer>", ["Paris"], 0.0, 1.0),
    ("<answer>London</answer>", ["Paris", "London"], 1.0, 1.0),  # any gold counts
    ("<answer>Lyon</answer> then <answer>Paris</answer>", ["Paris"], 1.0, 1.0),  # the last tag
    ("<answer>Paris</answer> then <answer>Lyon</answer>", ["Paris"], 0.0, 0.0),
    ("Paris", ["Paris"], 0.0, 0.0),  # no tag, no credit
    ("<answer></answer>", ["Paris"], 0.0, 0.0),
    ("<answer>Par</answer>", ["Paris"], 0.0, 0.0),
    ("<answer>Zorb Corp</answer>", "Zorb Corp", 1.0, 1.0),  # a bare string gold
]


@pytest.mark.parametrize("text,golds,em,sub", SEARCH)
def test_search_r1_em_and_substring(text, golds, em, sub):
    got = search_r1.compute_score(text, golds, "em")
    assert got == {"score": em, "em": em, "substring_em": sub}
    assert search_r1.compute_score(text, golds, "substring")["score"] == sub
    env = search_r1.SearchR1Env()
    kw = dict(final_text=text, ground_truth=golds, tool_rewards=[], turn_rewards=[])
    assert env.reward(extra_info={}, **kw)["score"] == em
    assert env.reward(extra_info={"reward_method": "substring"}, **kw)["score"] == sub


@pytest.mark.parametrize("raw,norm", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an   apple a day ", "apple day"),
    ("Theatre", "theatre"),  # "the" only as a whole word
    ("U.S.A.", "usa"),
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_extractors():
    assert extract_answer_tag("x <answer> a\nb </answer>") == "a\nb"
    assert extract_answer_tag("<answer>unclosed") is None
    assert extract_gsm8k("#### 3,500.", "strict") == "3,500"
    assert parse_number("3,500.") == 3500
    assert parse_number("abc") is None and parse_number(".") is None and parse_number(True) is None
