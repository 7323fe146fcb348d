"""The typed state that crosses processes: JobState through a checkpoint's builtins, and back."""

from __future__ import annotations

import pickle

import pytest

from asyncrl.job_state import JobState, RolloutPosition, RolloutState, StepResult


def test_job_state_round_trips_through_builtins_and_pickle():
    job = JobState(step=4, rollout=[RolloutPosition(next_position=9, started_groups=5, inflight_positions=[3, 7]),
                                    RolloutPosition()], trained_batch_ids=[2, 3])
    data = job.to_builtins()
    assert data["rollout"][0] == {"next_position": 9, "started_groups": 5, "inflight_positions": [3, 7]}
    assert JobState.from_builtins(data) == job
    state = RolloutState(worker_id=1, position=job.rollout[0], episodes=3, reward_sum=1.5)
    result = StepResult(version=5, batch_id=2, trained_uids=["a"], metrics={"x": 1.0})
    assert pickle.loads(pickle.dumps((job, state, result))) == (job, state, result)  # how Ray ships them


@pytest.mark.parametrize("bad,match", [
    ({"rollout": []}, "missing required field `step`"),
    ({"step": "4", "rollout": []}, r"Expected `int`, got `str` - at `\$.step`"),
    ({"step": 4, "rollout": [{"next_position": "x"}]}, r"at `\$.rollout\[0\].next_position`"),
    ({"step": 4, "rollout": [], "time": 1.0}, None),  # an unknown key from an older checkpoint is ignored
    ([1, 2], "Expected `object`, got `array`"),
])
def test_a_bad_job_state_names_the_field(bad, match):
    if match is None:
        assert JobState.from_builtins(bad).step == 4
        return
    with pytest.raises(ValueError, match=match):
        JobState.from_builtins(bad)
