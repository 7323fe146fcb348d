"""The progress watchdog (pure): stall and failing verdicts, the diagnosis it builds, and the exit status a run settles on."""

from __future__ import annotations

import pytest

from asyncrl.data.job_state import EpisodeError, RolloutPosition, RolloutState
from asyncrl.run.controller import settle
from asyncrl.run.watchdog import Watchdog


def state(worker_id=0, recent=0, failed=0, errors=(), skipped=0, dropped=0) -> RolloutState:
    return RolloutState(worker_id=worker_id, position=RolloutPosition(prompts_skipped=skipped),
                        recent_episodes=recent, recent_failed=failed, groups_dropped=dropped,
                        errors=[EpisodeError(message=m, count=c, data_index=i) for m, c, i in errors])


def dog(stall=60.0, fraction=0.9, window=64) -> Watchdog:
    return Watchdog(stall_timeout_s=stall, max_failed_fraction=fraction, window=window, now=1000.0)


def test_a_stall_is_measured_from_the_last_trained_step():
    w = dog(stall=60)
    assert not w.observe(1059.0, 0, []).stop
    assert not w.observe(1070.0, 1, []).stop  # a step: the clock starts again
    assert not w.observe(1129.0, 1, []).stop
    v = w.observe(1130.0, 1, [])
    assert v.kind == "stall" and v.stop
    assert v.diagnosis.startswith("no step trained after step 1 in 60 s (trainer.stall_timeout_s=60); "
                                  "no episode has finished")


def test_stall_timeout_zero_is_off():
    assert not dog(stall=0).observe(10 ** 9, 0, []).stop


def test_every_episode_failing_is_diagnosed_with_the_most_common_error_and_its_row():
    states = [state(0, recent=40, failed=40, errors=[("ValueError('boom')", 30, 17), ("KeyError('x')", 10, 3)]),
              state(1, recent=24, failed=24, errors=[("ValueError('boom')", 24, 5)], skipped=2, dropped=7)]
    v = dog(stall=0).observe(1001.0, 0, states)
    assert v.kind == "failing"
    assert v.diagnosis == ("episodes fail above trainer.max_failed_episode_fraction=0.9: 64 of the last 64 "
                           "episodes failed; most common error (54x): ValueError('boom') from row 17; "
                           "7 groups dropped unserved, 2 prompts skipped")


@pytest.mark.parametrize("recent,failed,window,stop", [
    (63, 63, 64, False),   # too few episodes to judge yet
    (64, 57, 64, False),   # 57 / 64 = 0.89: not more than 0.9
    (64, 58, 64, True),    # 0.906
    (200, 181, 64, True),
    (200, 180, 64, False),  # exactly 0.9 is not more
])
def test_failing_fraction_needs_a_full_window_and_more_than_the_bound(recent, failed, window, stop):
    v = dog(stall=0, window=window).observe(1001.0, 5, [state(recent=recent, failed=failed)])
    assert v.stop is stop and v.kind == ("failing" if stop else "ok")


def test_failing_wins_over_stall_and_fraction_one_is_off():
    states = [state(recent=64, failed=64)]
    assert dog(stall=1).observe(2000.0, 0, states).kind == "failing"
    assert dog(stall=1, fraction=1.0).observe(2000.0, 0, states).kind == "stall"


@pytest.mark.parametrize("kw", [dict(stall=-1), dict(fraction=0.0), dict(fraction=1.5), dict(window=0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="watchdog"):
        dog(**kw)


@pytest.mark.parametrize("code,skipped,expected", [(0, 0, 0), (0, 2, 3), (4, 2, 4), (130, 1, 130), (1, 5, 1)])
def test_the_exit_status_says_a_completed_run_skipped_prompts(code, skipped, expected):
    ending = {"exit_code": code, "exit_reason": "x", "diagnosis": ""}
    summary = settle(ending, {"prompts_skipped": skipped, "steps_trained": 3})
    assert summary["exit_code"] == expected and summary["steps_trained"] == 3
    assert (summary["exit_reason"] == "completed, 2 prompts skipped") is (expected == 3)


def test_skipped_optimizer_steps_also_make_a_completed_run_exit_3():
    ending = {"exit_code": 0, "exit_reason": "completed", "diagnosis": ""}
    summary = settle(ending, {"prompts_skipped": 1, "optimizer_steps_skipped": 2})
    assert summary["exit_code"] == 3
    assert summary["exit_reason"] == "completed, 1 prompts skipped, 2 optimizer steps skipped"
    assert settle(ending, {"prompts_skipped": 0, "optimizer_steps_skipped": 0})["exit_code"] == 0
