import pytest

from asyncrl.rollout.prompts import PromptSource, parse_group_id

ROWS = [{"i": i} for i in range(5)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    src = PromptSource(ROWS, seed=7)
    draws = [src.next() for _ in range(10)]
    e0 = [d.data_index for d in draws[:5]]
    e1 = [d.data_index for d in draws[5:]]
    assert sorted(e0) == sorted(e1) == list(range(5))
    assert [d.epoch for d in draws] == [0] * 5 + [1] * 5
    assert e0 != e1  # seeded per epoch (holds for seed 7)
    assert [d.group_id for d in draws[:3]] == ["g0", "g1", "g2"]


def test_resume_continues_the_same_stream():
    full = PromptSource(ROWS, seed=3)
    stream = [full.next().data_index for _ in range(12)]
    resumed = PromptSource(ROWS, seed=3, start_position=7)
    assert [resumed.next().data_index for _ in range(5)] == stream[7:12]


def test_shards_partition_positions():
    a = PromptSource(ROWS, seed=1, shard=0, num_shards=2)
    b = PromptSource(ROWS, seed=1, shard=1, num_shards=2)
    pa = [a.next().position for _ in range(4)]
    pb = [b.next().position for _ in range(4)]
    assert pa == [0, 2, 4, 6] and pb == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="does not belong to shard 1"):
        PromptSource(ROWS, seed=1, shard=1, num_shards=2, start_position=4)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], seed=0)


def test_a_retry_is_the_same_prompt_as_a_new_group():
    src = PromptSource(ROWS, seed=2)
    first, retry = src.at(3), src.at(3, retry=2)
    assert (first.group_id, retry.group_id) == ("g3", "g3r2")
    assert retry.data_index == first.data_index and retry.row is first.row
    assert parse_group_id(first.group_id) == (3, 0) and parse_group_id(retry.group_id) == (3, 2)


@pytest.mark.parametrize("bad", ["", "g", "3", "gx", "g3r", "g3r0", "g-1", "g3r-1", "val-3", " g3", "g3\n", "g3r2r1", "g03", "g3r02"])
def test_parse_group_id_refuses_what_is_not_a_training_group(bad):
    with pytest.raises(ValueError, match="is not a training group id"):
        parse_group_id(bad)
