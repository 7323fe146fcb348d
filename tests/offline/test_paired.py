"""Two evals compared episode by episode (asyncrl/offline/paired.py) and `asyncrl eval --against`."""

from __future__ import annotations

import json
import math
from argparse import Namespace

import pytest

from asyncrl.commands import eval as eval_cli
from asyncrl.offline.paired import against, compare, read_episodes, sign_test_p


def _eps(rewards: list[float], errors: dict[int, str] | None = None) -> list[dict]:
    errors = errors or {}
    return [{"data_index": i // 4, "sample_index": i % 4, "seed": 1000 + i, "reward": r, "error": errors.get(i, "")}
            for i, r in enumerate(rewards)]


def test_the_sign_test_is_the_exact_binomial_tail_doubled():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(3, 3) == 1.0  # capped: the two tails overlap at the middle
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)  # P(X=0) + P(X=5) of Binomial(5, 1/2)
    assert sign_test_p(0, 5) == sign_test_p(5, 0)
    # 15 up, 3 down (the lighter warm start's RL in the README's history): P(X <= 3 | n=18) doubled
    expect = 2 * sum(math.comb(18, i) for i in range(4)) / 2**18
    assert sign_test_p(15, 3) == pytest.approx(expect) and sign_test_p(15, 3) < 0.01
    assert sign_test_p(9, 7) > 0.5  # the default run's RL steps on one CPU: no evidence either way
    assert sign_test_p(600, 400) < 1e-9  # large counts stay exact (no float overflow in 2**n)
    with pytest.raises(ValueError, match="up=-1"):
        sign_test_p(-1, 2)


def test_compare_counts_the_changed_episodes_and_failed_ones_as_zero():
    base = _eps([0, 0, 1, 1, 0, 1, 0, 0])
    new = _eps([1, 0, 1, 0, 1, 1, 1, 0.5], errors={5: "engine step failed"})  # a failed episode is a failure
    r = compare(base, new)
    assert (r["up"], r["down"], r["unchanged"], r["episodes"]) == (3, 2, 3, 8)
    assert r["base_success"] == 0.375 and r["new_success"] == 0.5
    assert r["sign_test_p"] == pytest.approx(sign_test_p(3, 2), abs=1e-6)
    assert compare(base, new, threshold=0.5)["up"] == 4  # 0.5 counts as a success at threshold 0.5


def test_a_tiny_p_value_is_kept_to_three_significant_digits_not_rounded_to_zero():
    """55 up, 10 down (reasoning-gym's RL after its warm start): p = 1.18e-08, which 6 decimals made 0."""
    r = compare(_eps([0] * 55 + [1] * 10 + [0] * 5), _eps([1] * 55 + [0] * 10 + [0] * 5))
    assert (r["up"], r["down"]) == (55, 10) and r["sign_test_p"] == 1.18e-08
    block, line = against(_eps([0] * 55 + [1] * 10), _eps([1] * 55 + [0] * 10), 1.0, "sft", "final")
    assert "sign test p = 1.18e-08 (significant at 0.05)" in line


def test_compare_refuses_evals_of_different_episodes_and_names_one():
    base = _eps([0, 1, 1, 0])
    shifted = [dict(e, seed=e["seed"] + 1) for e in base]  # another --seed: other draws, nothing pairs
    with pytest.raises(ValueError, match=r"did not run the same episodes.*4 only in A.*4 only in B.*--seed"):
        compare(base, shifted)
    with pytest.raises(ValueError, match="1 only in A"):
        compare(base, base[:3])
    with pytest.raises(ValueError, match="appears twice"):
        compare(base + base[:1], base)
    with pytest.raises(ValueError, match="no episodes"):
        compare([], [])


def test_against_keeps_the_eval_standing_when_nothing_pairs():
    block, line = against(_eps([0, 1, 1, 0]), _eps([1, 1, 1, 0]), 1.0, "ev_warm", "final")
    assert block["eval_dir"] == "ev_warm" and block["up"] == 1 and "1 up, 0 down" in line and "not significant" in line
    block, line = against(_eps([0, 1]), _eps([0, 1, 1, 0]), 1.0, "ev_warm", "final")
    assert "error" in block and "no comparison" in line and "up" not in block


def test_read_episodes_refuses_what_is_not_an_eval(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*--out dir"):
        read_episodes(tmp_path / "nowhere")
    bad = [
        ('{"data_index": 0, "sample_index": 0, "seed": 1}', "no 'reward'"),
        ('{"data_index": 0, "sample_index": 0, "seed": 1, "reward": NaN}', "not finite"),
        ('{"data_index": 0, "sample_index": 0, "seed": 1, "reward": "1e999"}', "not finite"),
        ('{"data_index": 0, "sample_index": 0, "seed": 1, "reward": [1]}', "not an eval episode"),
        ("not json", "not an eval episode"),
    ]
    for i, (line, words) in enumerate(bad):
        d = tmp_path / f"e{i}"
        d.mkdir()
        (d / "episodes.jsonl").write_text(json.dumps(_eps([1])[0]) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=words) as e:
            read_episodes(d)
        assert "episodes.jsonl:2" in str(e.value)  # the file and the line
    good = tmp_path / "good"
    good.mkdir()
    (good / "episodes.jsonl").write_text("\n".join(json.dumps(e) for e in _eps([1, 0])) + "\n\n")
    assert [e["reward"] for e in read_episodes(good)] == [1, 0]


def test_eval_checks_against_before_it_starts(tiny_model_dir, tmp_path, capsys):
    """`--against` is read before any engine starts: a missing dir is a usage error (exit 2), and --dry-run
    reports what would run (no output dir made)."""
    args = [str(tiny_model_dir), "model=custom", "env.num_val=3", "env.num_train=3"]
    out = tmp_path / "ev"
    assert eval_cli.main(Namespace(argv=[*args, "--against", str(tmp_path / "none"), "--out", str(out)])) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()
    base = tmp_path / "base"
    base.mkdir()
    (base / "episodes.jsonl").write_text(json.dumps(_eps([1])[0]) + "\n")
    assert eval_cli.main(Namespace(argv=[*args, "--dry-run", "--against", str(base), "--out", str(out)])) == 0
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said["dry_run"] and said["rows"] == 3 and said["against"] == str(base) and not out.exists()
