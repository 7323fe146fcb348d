"""Streamed datasets (asyncrl/data/dataset.py): the reader gives exactly the rows `to_pylist` gives, holds at most
its configured number of decoded blocks, ships as a small handle, and a damaged file or a missing column
is an error naming the file when it is opened; a bad row is an error naming file and row when drawn."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.cli import main as cli_main
from asyncrl.data.dataset import Dataset, open_dataset
from asyncrl.data.rows import DataError, normalize_row, write_rows
from asyncrl.rollout.prompts import PromptSource
from asyncrl.run import preflight as preflight_module
from asyncrl.run.preflight import check_training_sample


def _row(i: int) -> dict:
    """A verl row whose optional parts vary: nulls, nested lists and structs, non-ASCII text."""
    extra = {"index": i, "tools_kwargs": {"calculator": {"create_kwargs": {"g": str(i)}}} if i % 3 == 0 else None,
             "tags": [f"t{j}" for j in range(i % 4)], "note": None if i % 5 == 0 else f"ñoté {i} — 数学 🙂"}
    return {"data_source": "arith" if i % 2 else None,
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i} + {i} = ? 答え"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": extra, "agent_name": None if i % 7 else "tool_agent"}


ROWS = [_row(i) for i in range(101)]


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=13)  # 8 groups, the last one short
    return path


def test_reader_gives_exactly_the_rows_to_pylist_gives_at_random_indices(parquet_file):
    expected = pq.read_table(parquet_file).to_pylist()
    ds = open_dataset(parquet_file, block_rows=5, cache_blocks=2)  # blocks of 5 inside groups of 13
    assert pq.ParquetFile(parquet_file).metadata.num_row_groups == 8 and len(ds) == len(expected) == 101
    assert [(b.group, b.offset, b.count) for b in ds.blocks[:4]] == [(0, 0, 5), (0, 5, 5), (0, 10, 3), (1, 0, 5)]
    order = list(range(len(ds))) * 2
    random.Random(0).shuffle(order)
    for i in order:
        assert ds.raw(i) == expected[i], i
        assert ds[i] == normalize_row(expected[i])  # validated, struct-filled nulls taken out as read_rows does
    assert ds[-1] == ds[100] and ds[3:6] == [ds[3], ds[4], ds[5]]
    with pytest.raises(IndexError, match="row 101 out of range"):
        ds[101]


def test_jsonl_rows_read_back_as_written(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in ROWS[:40]) + "\n\n", encoding="utf-8")
    ds = open_dataset(path, block_rows=6, cache_blocks=1)
    assert len(ds) == 40 and len(ds.blocks) == 7
    for i in random.Random(1).sample(range(40), 40):
        assert ds.raw(i) == ROWS[i]


def test_the_cache_never_holds_more_than_its_blocks(parquet_file):
    ds = open_dataset(parquet_file, block_rows=4, cache_blocks=3)
    rng = random.Random(2)
    for _ in range(300):
        ds.raw(rng.randrange(len(ds)))
        assert len(ds.reader.cache) <= 3
    assert len(ds.reader.cache) == 3 and ds.reader.decoded > 3  # it did evict (and decode again)
    assert all(t.num_rows <= 4 for t in ds.reader.cache.values())
    before = ds.reader.decoded
    last = next(reversed(ds.reader.cache))
    ds.raw(ds.blocks[last].start)  # a hit decodes nothing
    assert ds.reader.decoded == before


def test_the_handle_ships_without_rows_or_cache(tmp_path):
    path = write_rows([_row(i) for i in range(20_000)], tmp_path / "big.parquet")  # row groups of 4096
    ds = open_dataset(path)
    ds[12_345]
    blob = pickle.dumps(ds)
    assert len(blob) < 4_000 < path.stat().st_size  # a path, a few numbers per block: not the rows
    copy = pickle.loads(blob)
    assert copy._reader is None and copy[12_345] == ds[12_345] and len(copy) == 20_000


def test_worker_shards_draw_what_the_in_memory_rows_drew(parquet_file):
    ds = open_dataset(parquet_file, block_rows=8)
    n = len(ds)
    for shard in range(3):
        new = PromptSource(ds, run_id="t", seed=11, shard=shard, num_shards=3)
        old = PromptSource(ROWS, run_id="t", seed=11, shard=shard, num_shards=3)  # rows held in memory, as before
        for _ in range(80):  # more than an epoch of this shard's positions
            a, b = new.next(), old.next()
            perm = np.random.default_rng([11, a.position // n]).permutation(n)  # the documented permutation
            assert (a.position, a.epoch, a.data_index) == (b.position, b.epoch, b.data_index)
            assert a.data_index == perm[a.position % n] and a.position % 3 == shard
            assert a.row == normalize_row(pq.read_table(parquet_file).slice(a.data_index, 1).to_pylist()[0])


def _bad(path, content) -> str:
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        open_dataset(path)
    assert str(path) in str(e.value)
    return str(e.value)


def test_damaged_files_and_missing_columns_are_named_when_opened(parquet_file, tmp_path):
    data = parquet_file.read_bytes()
    assert "cannot read as parquet" in _bad(tmp_path / "cut.parquet", data[: len(data) // 2])
    assert "cannot read as parquet" in _bad(tmp_path / "tail.parquet", data[:-3] + b"XYZ")
    assert "cannot read as parquet" in _bad(tmp_path / "empty.parquet", b"")
    no_rm = tmp_path / "no_rm.parquet"
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "reward_model"} for r in ROWS]), no_rm)
    with pytest.raises(DataError, match=r"no_rm\.parquet: missing column reward_model \(the file has: data_source"):
        open_dataset(no_rm)
    no_gt = tmp_path / "no_gt.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "reward_model": {"style": "rule"}} for r in ROWS]), no_gt)
    with pytest.raises(DataError, match="reward_model must be a struct with a ground_truth field"):
        open_dataset(no_gt)
    assert "last line is not JSON" in _bad(tmp_path / "cut.jsonl", b'{"prompt": []}\n{"prompt": [')
    with pytest.raises(DataError, match="no such file"):
        open_dataset(tmp_path / "nope.parquet")
    (tmp_path / "rows.csv").write_text("prompt\n")
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        open_dataset(tmp_path / "rows.csv")
    pq.write_table(pa.Table.from_pylist(ROWS).slice(0, 0), tmp_path / "none.parquet")
    with pytest.raises(DataError, match="none.parquet: no rows"):
        open_dataset(tmp_path / "none.parquet")


def test_a_damaged_page_is_an_error_naming_file_and_rows_when_read(parquet_file, tmp_path):
    meta = pq.ParquetFile(parquet_file).metadata.row_group(3)
    start = min(meta.column(c).data_page_offset for c in range(meta.num_columns))
    data = bytearray(parquet_file.read_bytes())
    data[start: start + 200] = bytes(200)  # zero a row group's pages; the footer stays intact
    bad = tmp_path / "zeroed.parquet"
    bad.write_bytes(bytes(data))
    ds = open_dataset(bad, block_rows=13)
    with pytest.raises(DataError, match=r"zeroed\.parquet: cannot read rows 39\.\.51"):
        ds.raw(40)
    assert ds.raw(0) == pq.read_table(parquet_file).slice(0, 1).to_pylist()[0]  # the other groups still read


def test_a_file_changed_under_its_handle_is_refused(tmp_path):
    path = write_rows(ROWS[:10], tmp_path / "rows.parquet")
    ds = open_dataset(path)
    write_rows(ROWS[10:30], path)
    os.utime(path, ns=(1, 1))  # whatever the clock's resolution: the mtime differs
    with pytest.raises(DataError, match="the file changed since the run opened it"):
        ds[0]


def _rows_with_bad(tmp_path, bad_at: set[int]):
    rows = [{**r, "prompt": []} if i in bad_at else r for i, r in enumerate(ROWS[:10])]
    path = tmp_path / "some_bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_bad_row_is_named_when_drawn_or_passed_over_with_skip_bad(tmp_path):
    path = _rows_with_bad(tmp_path, {2, 7})
    src = PromptSource(open_dataset(path), run_id="t", seed=0, shuffle=False)
    draws = [src.next() for _ in range(10)]
    assert [d.data_index for d in draws if d.error] == [2, 7] and draws[2].row is None
    assert draws[2].error == f"{path.resolve()}, row 2, field 'prompt': must be a non-empty list of {{role, content}} messages, got []"
    skipping = PromptSource(open_dataset(path, skip_bad=True), run_id="t", seed=0, shuffle=False, shard=1, num_shards=2)
    got = [skipping.next() for _ in range(4)]
    assert [d.position for d in got] == [1, 3, 5, 9] and skipping.rows_skipped == 1 and not any(d.error for d in got)
    resumed = PromptSource(open_dataset(path, skip_bad=True), run_id="t", seed=0, shuffle=False, shard=1, num_shards=2,
                           start_position=5)
    assert [resumed.next().position for _ in range(2)] == [5, 9]  # the same positions passed over


def test_a_dataset_of_only_bad_rows_stops_the_draws_with_a_named_error(tmp_path):
    path = _rows_with_bad(tmp_path, set(range(10)))
    src = PromptSource(open_dataset(path, skip_bad=True), run_id="t", seed=0)
    with pytest.raises(DataError, match=r"some_bad\.jsonl: 10 positions in a row drew bad rows"):
        src.next()


def test_rows_built_in_memory_are_shipped_and_trusted():
    ds = Dataset.from_rows([{"i": 1}, {"i": 2}])
    assert len(ds) == 2 and ds[1] == {"i": 2} and pickle.loads(pickle.dumps(ds))[0] == {"i": 1}
    assert ds.sample_indices(5) == [0, 1]
    with pytest.raises(DataError, match="row 1: dropped by the preflight"):
        ds.skipping([1])[1]


def test_sample_indices_spread_whole_blocks_over_a_large_file(parquet_file):
    ds = open_dataset(parquet_file, block_rows=10)
    got = ds.sample_indices(30)
    assert len(got) == len(set(got)) == 30 and got[:10] == list(range(10)) and 100 in got  # first and last blocks
    touched = {b for b, blk in enumerate(ds.blocks) if any(blk.start <= i < blk.start + blk.count for i in got)}
    assert len(touched) == 3  # whole blocks spread over the file: three decoded, not thirty


@pytest.mark.parametrize("damage", ["truncated", "no_prompt_column"])
def test_asyncrl_train_refuses_a_damaged_file_in_one_line_naming_it_before_starting(damage, parquet_file, tmp_path,
                                                                                  tiny_model_dir, capsys):
    bad = tmp_path / f"{damage}.parquet"
    if damage == "truncated":
        bad.write_bytes(parquet_file.read_bytes()[:-100])
        fragment = f"env=arithmetic training rows: {bad}: cannot read as parquet"
    else:
        pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "prompt"} for r in ROWS]), bad)
        fragment = f"env=arithmetic training rows: {bad}: missing column prompt"
    out = tmp_path / "out"
    rc = cli_main(["train", "model=custom", f"model.path={tiny_model_dir}", f"trainer.output_dir={out}",
                   f"env.train_file={bad}", "trainer.wandb=off"])
    err = capsys.readouterr().err
    assert (rc, len(err.strip().splitlines())) == (2, 1), err
    assert fragment in err and not out.exists()


def test_the_preflight_warns_of_row_groups_too_large_to_draw_from_cheaply(tmp_path, monkeypatch):
    path = tmp_path / "one_group.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)  # one row group of 101 rows
    ds = open_dataset(path, block_rows=10)
    assert ds.largest_row_group == 101 and len(ds.blocks) == 11
    assert check_training_sample(ds)[2] == []
    monkeypatch.setattr(preflight_module, "LARGE_ROW_GROUP", 100)
    (warning,) = check_training_sample(ds)[2]
    assert warning.startswith(f"{path}: row groups of up to 101 rows: each prompt drawn decodes up to that many")
