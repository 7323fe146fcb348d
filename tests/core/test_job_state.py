"""The typed state that crosses processes: JobState through a checkpoint's builtins, and back."""

from __future__ import annotations

import pickle

import pytest

from asyncrl.data.job_state import JobState, RolloutPosition, RolloutState, StepResult


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


def test_a_position_keeps_what_drop_reports_changed_through_a_checkpoint():
    pos = RolloutPosition(next_position=12, started_groups=9, inflight_positions=[10], returned_groups=4,
                          retries={2: 3, 6: 1}, waiting_positions=[6], prompts_skipped=1)
    job = JobState(step=3, rollout=[pos])
    back = JobState.from_builtins(pickle.loads(pickle.dumps(job.to_builtins())))  # as meta.pt holds it
    assert back == job and back.rollout[0].retries == {2: 3, 6: 1}
    assert RolloutPosition().__struct_config__.omit_defaults and JobState(step=0, rollout=[RolloutPosition()]) \
        .to_builtins()["rollout"] == [{}]  # a checkpoint of a fresh run names no field it does not use
    with pytest.raises(ValueError, match=r"at `key` in `\$.rollout\[0\].retries`"):
        JobState.from_builtins({"step": 1, "rollout": [{"retries": {"x": 1}}]})
