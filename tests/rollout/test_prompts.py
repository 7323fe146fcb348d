import pytest

from asyncrl.data.group_ids import GroupKey, group_id, parse_group_id
from asyncrl.rollout.prompts import PromptSource
from asyncrl.run_dir import check_run_id, new_run_id

ROWS = [{"i": i} for i in range(5)]
RUN = "k3x9"


def test_each_epoch_is_a_permutation_and_epochs_differ():
    src = PromptSource(ROWS, run_id=RUN, seed=7)
    draws = [src.next() for _ in range(10)]
    e0 = [d.data_index for d in draws[:5]]
    e1 = [d.data_index for d in draws[5:]]
    assert sorted(e0) == sorted(e1) == list(range(5))
    assert [d.epoch for d in draws] == [0] * 5 + [1] * 5
    assert e0 != e1  # seeded per epoch (holds for seed 7)
    assert [d.group_id for d in draws[:3]] == ["k3x9-g0", "k3x9-g1", "k3x9-g2"]


def test_resume_continues_the_same_stream():
    full = PromptSource(ROWS, run_id=RUN, seed=3)
    stream = [full.next().data_index for _ in range(12)]
    resumed = PromptSource(ROWS, run_id=RUN, seed=3, start_position=7)
    assert [resumed.next().data_index for _ in range(5)] == stream[7:12]


def test_shards_partition_positions():
    a = PromptSource(ROWS, run_id=RUN, seed=1, shard=0, num_shards=2)
    b = PromptSource(ROWS, run_id=RUN, seed=1, shard=1, num_shards=2)
    pa = [a.next().position for _ in range(4)]
    pb = [b.next().position for _ in range(4)]
    assert pa == [0, 2, 4, 6] and pb == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="does not belong to shard 1"):
        PromptSource(ROWS, run_id=RUN, seed=1, shard=1, num_shards=2, start_position=4)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], run_id=RUN, seed=0)


def test_a_retry_is_the_same_prompt_as_a_new_group():
    src = PromptSource(ROWS, run_id=RUN, seed=2)
    first, retry = src.at(3), src.at(3, retry=2)
    assert (first.group_id, retry.group_id) == ("k3x9-g3", "k3x9-g3r2")
    assert retry.data_index == first.data_index and retry.row is first.row
    assert parse_group_id(first.group_id) == GroupKey("k3x9", 3, 0)
    assert parse_group_id(retry.group_id) == GroupKey(run_id="k3x9", position=3, retry=2)


def test_group_ids_of_two_runs_never_meet():
    a, b = PromptSource(ROWS, run_id="a1", seed=2), PromptSource(ROWS, run_id="a", seed=2)
    ids_a = {a.at(p, r).group_id for p in range(20) for r in range(3)}
    ids_b = {b.at(p, r).group_id for p in range(20) for r in range(3)}
    assert not ids_a & ids_b
    assert {parse_group_id(g).run_id for g in ids_a} == {"a1"} and len(ids_a) == 60
    assert parse_group_id(group_id("0123456789abcdef", 10**17, 5)) == GroupKey("0123456789abcdef", 10**17, 5)


@pytest.mark.parametrize("bad", ["", "g", "3", "gx", "g3", "g3r2", "-g3", "r1-g", "r1-g3r", "r1-g3r0", "r1-g-1",
                                 "r1-g3r-1", "val-3", " r1-g3", "r1-g3\n", "r1-g3r2r1", "r1-g03", "r1-g3r02",
                                 "R1-g3", "r_1-g3", "r1--g3", "r1-g3-0", "0123456789abcdefg-g3", "r1-g" + "9" * 19,
                                 "r1-g3r" + "9" * 19, "r1-g\u0663", "r\u00e9-g3", "r1-g3\x00", None, 3, b"r1-g3"])
def test_parse_group_id_refuses_what_is_not_a_training_group(bad):
    with pytest.raises(ValueError, match="is not a training group id") as e:
        parse_group_id(bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", ["", "A", "ab-c", "a b", "0123456789abcdefg", "\u00e9", "a\n", None, 7])
def test_a_hostile_run_id_is_refused_where_it_enters(bad):
    with pytest.raises(ValueError, match="is not a run id"):
        PromptSource(ROWS, run_id=bad, seed=0)
    with pytest.raises(ValueError, match="is not a run id"):
        group_id(bad, 1)


def test_new_run_ids_are_valid_and_differ():
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(check_run_id(i, "test") == i and len(i) == 8 for i in ids)
