"""asyncrl/bench/rounds.py: sides interleaved in order, medians and ratios of medians."""

import pytest

from asyncrl.bench.rounds import interleave, machine, ratio, summary


def test_sides_run_in_turns_and_keep_their_figures_in_round_order():
    calls: list[str] = []
    figures = {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}

    def side(name):
        def one():
            calls.append(name)
            return next(figures[name])
        return one

    got = interleave({"a": side("a"), "b": side("b")}, rounds=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert got == {"a": [3.0, 1.0, 2.0], "b": [10.0, 30.0, 20.0]}


def test_summary_is_the_median_with_its_spread_and_the_ratio_is_of_medians():
    assert summary("x", [3.0, 1.0, 2.0, 100.0]) == {"x": 2.5, "x_min": 1.0, "x_max": 100.0,
                                                     "x_all": [3.0, 1.0, 2.0, 100.0]}
    # per-round ratios would be 10, 30, 1 (median 10); the ratio of medians is 20 / 1
    assert ratio([10.0, 30.0, 20.0], [1.0, 1.0, 20.0]) == 20.0


def test_zero_rounds_is_refused_and_machine_reports_cpus():
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        interleave({"a": lambda: 1.0}, rounds=0)
    m = machine()
    assert m["cpus"] >= 1 and (m["loadavg_1m"] is None or m["loadavg_1m"] >= 0)
