"""trainer.max_minutes as a bound: a step starts only when it is expected to end within the budget."""

from __future__ import annotations

from asyncrl.run.controller import next_step_fits


def test_no_budget_always_fits():
    assert next_step_fits(1e9, None, [1e6])


def test_the_first_step_starts_while_time_is_left_and_never_after():
    assert next_step_fits(99.0, 100.0, [])
    assert not next_step_fits(100.0, 100.0, [])
    assert not next_step_fits(150.0, 100.0, [])


def test_a_step_that_would_end_past_the_budget_does_not_start():
    # steps of 80 and 90 s: the next is expected to take 85 s
    assert next_step_fits(1000.0, 1085.0, [80.0, 90.0])
    assert not next_step_fits(1000.0, 1084.9, [80.0, 90.0])
    # by the median: the first step's wait for the first rollouts counts for less once more steps ran
    assert not next_step_fits(1000.0, 1100.0, [180.0, 80.0])
    assert next_step_fits(1000.0, 1100.0, [180.0, 80.0, 90.0])
