"""Datasets read from disk a block at a time: a handle cheap to ship, a reader bounded in memory.

`open_dataset(path)` reads only a parquet file's footer (row count, row groups, schema) or makes
one pass over a jsonl file's bytes (counting lines, keeping the byte offset of every
`BLOCK_ROWS`-th), checks what it can without reading rows (the required columns of the schema, a
truncated or corrupt footer, a jsonl file's first and last line), and returns a `Dataset`: the
path, the file's size and mtime, the row count and a block index (a few numbers per
`BLOCK_ROWS` rows), never the rows. That is what crosses to the rollout actors.

A `Dataset` is a `Sequence` of rows: `ds[i]` is row i, read through a per-process reader that
decodes the block holding i and keeps the last `cache_blocks` decoded blocks (an LRU), so a
process holds at most `cache_blocks * BLOCK_ROWS` decoded rows whatever the file's size. A parquet
block is `BLOCK_ROWS` rows of one row group; a larger row group is decoded batch by batch up to the
block wanted, which costs CPU and memory in proportion to the group (`largest_row_group`; the
preflight warns above `LARGE_ROW_GROUP` rows); files written by `asyncrl data` use row groups of
`BLOCK_ROWS` rows. `ds[i]` normalises the row as `read_rows`
does and validates it (`validate_row`); a bad row raises `DataError` naming the file and row i.
`ds.raw(i)` is the row exactly as `pyarrow`'s `to_pylist` (or `json.loads`) gives it.

A file that changed (size or mtime) since its handle was made is an error at its next block read:
a position must keep drawing the same row, which resume depends on.

`Dataset.from_rows(rows)` wraps rows an env built in memory (`Env.build`): small by
construction, shipped as they are, and trusted (not validated), as before.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union, overload

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.data.rows import ROW_GROUP_ROWS, DataError, normalize_row, validate_row

BLOCK_ROWS = ROW_GROUP_ROWS  # rows decoded at a time: one row group of a file `write_rows` wrote
CACHE_BLOCKS = 4  # decoded blocks a reader keeps
LARGE_ROW_GROUP = 65_536  # rows of a row group above which a draw's cost grows with the group (warned about)
REQUIRED_COLUMNS = ("prompt", "reward_model")


@dataclass(frozen=True)
class Block:
    """Rows [start, start + count) of the file: in parquet row group `group` from row `offset` of
    that group; in jsonl from byte `offset`."""

    start: int
    count: int
    offset: int
    group: int = -1


class Dataset(Sequence):
    """A file's rows, read on demand (see module doc), or rows built in memory (`from_rows`)."""

    def __init__(self, path: Optional[str], *, fmt: str, num_rows: int, blocks: tuple[Block, ...] = (),
                 size: int = 0, mtime_ns: int = 0, columns: tuple[str, ...] = (),
                 rows: Optional[list[dict[str, Any]]] = None, skip_bad: bool = False,
                 skip: frozenset[int] = frozenset(), cache_blocks: int = CACHE_BLOCKS):
        if cache_blocks < 1:
            raise ValueError(f"cache_blocks must be >= 1, got {cache_blocks}")
        self.path, self.fmt, self.num_rows, self.blocks = path, fmt, num_rows, blocks
        self.size, self.mtime_ns, self.columns, self._rows = size, mtime_ns, columns, rows
        self.skip_bad, self.skip, self.cache_blocks = skip_bad, skip, cache_blocks
        self._reader: Optional[_Reader] = None

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]], *, skip_bad: bool = False) -> Dataset:
        return cls(None, fmt="memory", num_rows=len(rows), rows=list(rows), skip_bad=skip_bad)

    def skipping(self, indices: Iterable[int]) -> Dataset:
        """The same rows, with `indices` marked to be skipped when drawn (e.g. the preflight found their
        prompt too long); `ds[i]` of one raises DataError."""
        return Dataset(**{**self._state(), "skip": self.skip | frozenset(int(i) for i in indices)})

    # ------------------------------------------------------------------ pickling: the handle, never the cache

    def _state(self) -> dict[str, Any]:
        return {"path": self.path, "fmt": self.fmt, "num_rows": self.num_rows, "blocks": self.blocks,
                "size": self.size, "mtime_ns": self.mtime_ns, "columns": self.columns, "rows": self._rows,
                "skip_bad": self.skip_bad, "skip": self.skip, "cache_blocks": self.cache_blocks}

    def __reduce__(self) -> tuple:
        return (_rebuild, (self._state(),))

    # ------------------------------------------------------------------ Sequence

    def __len__(self) -> int:
        return self.num_rows

    @property
    def source(self) -> str:
        return self.path or "(rows built in memory)"

    def __repr__(self) -> str:
        return f"Dataset({self.source!r}, {self.num_rows} rows, {self.fmt})"

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_rows))]
        index = self._index(i)
        if index in self.skip:
            raise DataError("dropped by the preflight (its prompt is longer than agent.max_prompt_tokens)",
                            index=index, source=self.source)
        if self._rows is not None:
            return self._rows[index]
        row = self.raw(index)
        if isinstance(row, dict):
            row = normalize_row(row)
        try:
            validate_row(row, index)
        except DataError as e:
            raise DataError(e.message, index=index, field=e.field, source=self.path) from None
        return row

    def raw(self, i: int) -> Any:
        """Row i as read: pyarrow's `to_pylist` row, or the parsed json line."""
        index = self._index(i)
        if self._rows is not None:
            return self._rows[index]
        return self.reader.row(index)

    def _index(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"a row index is an int, got {type(i).__name__}")
        index = i + self.num_rows if i < 0 else i
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {i} out of range: {self.source} has {self.num_rows} rows")
        return index

    @property
    def reader(self) -> _Reader:
        if self._reader is None:
            self._reader = _Reader(self)
        return self._reader

    @property
    def largest_row_group(self) -> int:
        """Rows of the file's largest parquet row group (0 for jsonl and rows in memory): a draw decodes up to
        that many rows, and a worker's memory holds what decoding one takes."""
        groups: dict[int, int] = {}
        for b in self.blocks:
            if b.group >= 0:
                groups[b.group] = groups.get(b.group, 0) + b.count
        return max(groups.values(), default=0)

    def sample_indices(self, limit: int) -> list[int]:
        """Up to `limit` row indices to check before a run: every row if there are at most `limit`, else
        whole blocks spread evenly over the file (first and last included), so a check decodes few blocks."""
        if self.num_rows <= limit:
            return list(range(self.num_rows))
        blocks = self.blocks or (Block(0, self.num_rows, 0),)
        per = max(b.count for b in blocks)
        for k in range(max(1, -(-limit // per)), len(blocks) + 1):  # the fewest evenly spread blocks that hold enough
            chosen = sorted({round(j * (len(blocks) - 1) / max(k - 1, 1)) for j in range(k)})
            if sum(blocks[j].count for j in chosen) >= limit:
                break
        out: list[int] = []
        for b in (blocks[j] for j in dict.fromkeys([chosen[0], chosen[-1], *chosen[1:-1]])):  # the file's two ends first
            take = min(b.count, limit - len(out))
            out.extend(range(b.start, b.start + take))
            if len(out) >= limit:
                break
        return sorted(out)


def _rebuild(state: dict[str, Any]) -> Dataset:
    return Dataset(**state)


class _Reader:
    """One process's view of a Dataset's file: the open file and an LRU of decoded blocks."""

    def __init__(self, ds: Dataset):
        self.ds = ds
        self.cache: OrderedDict[int, Any] = OrderedDict()  # block number -> pa.Table (parquet) | list (jsonl)
        self.decoded = 0  # blocks decoded so far (a cache miss each)
        self._starts = [b.start for b in ds.blocks]
        self._parquet: Optional[pq.ParquetFile] = None

    def row(self, index: int) -> Any:
        n = _bisect(self._starts, index)
        block = self.ds.blocks[n]
        data = self.cache.get(n)
        if data is None:
            data = self._decode(block)
            self.decoded += 1
            self.cache[n] = data
            while len(self.cache) > self.ds.cache_blocks:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(n)
        k = index - block.start
        return data[k] if isinstance(data, list) else data.slice(k, 1).to_pylist()[0]

    def _decode(self, b: Block) -> Any:
        path = self.ds.path
        where = f"rows {b.start}..{b.start + b.count - 1}"
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(f"cannot read {where}: {e}", source=path) from e
        if (st.st_size, st.st_mtime_ns) != (self.ds.size, self.ds.mtime_ns):
            raise DataError(f"the file changed since the run opened it (size {self.ds.size} -> {st.st_size}); "
                            "a run's dataset must not change under it (resume maps positions to rows)", source=path)
        try:
            return self._decode_parquet(b) if self.ds.fmt == "parquet" else self._decode_jsonl(b)
        except DataError:
            raise
        except Exception as e:  # a damaged page, an unreadable line: named, not a traceback from pyarrow
            raise DataError(f"cannot read {where}: {type(e).__name__}: {e}", source=path) from e

    def _decode_parquet(self, b: Block) -> pa.Table:
        if self._parquet is None:
            self._parquet = pq.ParquetFile(self.ds.path)
        pieces, seen = [], 0  # rows of the group passed so far
        for batch in self._parquet.iter_batches(batch_size=b.count, row_groups=[b.group], use_threads=False):
            lo, hi = max(b.offset - seen, 0), min(b.offset + b.count - seen, batch.num_rows)
            if lo < hi:
                pieces.append(batch.slice(lo, hi - lo))
            seen += batch.num_rows
            if seen >= b.offset + b.count:
                break
        table = pa.Table.from_batches(pieces) if pieces else None
        if table is None or table.num_rows != b.count:
            got = 0 if table is None else table.num_rows
            raise DataError(f"row group {b.group} gave {got} of its rows {b.offset}..{b.offset + b.count - 1}",
                            source=self.ds.path)
        return table.combine_chunks()

    def _decode_jsonl(self, b: Block) -> list[Any]:
        rows: list[Any] = []
        with open(self.ds.path, "rb") as f:
            f.seek(b.offset)
            for line in f:
                if not line.strip():
                    continue
                index = b.start + len(rows)
                try:
                    rows.append(json.loads(line))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"line of row {index} is not JSON: {e}", index=index, source=self.ds.path) from e
                if len(rows) == b.count:
                    break
        if len(rows) != b.count:
            raise DataError(f"ended after {len(rows)} of the {b.count} rows from row {b.start}", source=self.ds.path)
        return rows


def _bisect(starts: list[int], index: int) -> int:
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= index:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ----------------------------------------------------------------------------- opening a file


def open_dataset(path: str | Path, *, skip_bad: bool = False, cache_blocks: int = CACHE_BLOCKS,
                 block_rows: int = BLOCK_ROWS) -> Dataset:
    """The handle of a parquet or jsonl file (see module doc); DataError naming the file if it cannot be
    one: missing, unknown suffix, unreadable footer, a required column missing, no rows."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"no such file (resolved to {p.resolve()})", source=str(path))
    p = p.resolve()
    st = p.stat()
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        fmt, num_rows, blocks, columns = "parquet", *_index_parquet(p, block_rows)
    elif suffix in (".jsonl", ".json"):
        fmt, columns = "jsonl", ()
        num_rows, blocks = _index_jsonl(p, block_rows)
    else:
        raise DataError(f"unknown file type {suffix!r}; expected .parquet or .jsonl", source=str(path))
    if num_rows == 0:
        raise DataError("no rows", source=str(p))
    return Dataset(str(p), fmt=fmt, num_rows=num_rows, blocks=blocks, size=st.st_size, mtime_ns=st.st_mtime_ns,
                   columns=columns, skip_bad=skip_bad, cache_blocks=cache_blocks)


def _index_parquet(p: Path, block_rows: int) -> tuple[int, tuple[Block, ...], tuple[str, ...]]:
    try:
        meta = pq.ParquetFile(p).metadata
        schema = meta.schema.to_arrow_schema()
    except Exception as e:  # a truncated file, a damaged footer, not parquet at all
        raise DataError(f"cannot read as parquet: {e}", source=str(p)) from e
    names = tuple(schema.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataError(f"missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        f"(the file has: {', '.join(names) or 'none'})", source=str(p))
    rm = schema.field("reward_model").type
    if not pa.types.is_struct(rm) or rm.get_field_index("ground_truth") < 0:
        raise DataError(f"column reward_model must be a struct with a ground_truth field, is {rm}", source=str(p))
    prompt = schema.field("prompt").type
    if not (pa.types.is_list(prompt) or pa.types.is_large_list(prompt) or pa.types.is_string(prompt)
            or pa.types.is_large_string(prompt)):
        raise DataError(f"column prompt must be a list of messages, is {prompt}", source=str(p))
    blocks, start = [], 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        for off in range(0, n, block_rows):
            count = min(block_rows, n - off)
            blocks.append(Block(start, count, off, g))
            start += count
    if start != meta.num_rows:
        raise DataError(f"row groups hold {start} rows, the footer says {meta.num_rows}", source=str(p))
    return meta.num_rows, tuple(blocks), names


def _index_jsonl(p: Path, block_rows: int) -> tuple[int, tuple[Block, ...]]:
    offsets, num_rows, pos, first, last = [], 0, 0, None, None
    with open(p, "rb") as f:
        for line in f:
            if line.strip():
                if num_rows % block_rows == 0:
                    offsets.append(pos)
                if first is None:
                    first = line
                last = line
                num_rows += 1
            pos += len(line)
    for what, line, index in (("first", first, 0), ("last", last, num_rows - 1)):
        if line is not None:
            try:
                json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"the {what} line is not JSON (a truncated file?): {e}", index=index,
                                source=str(p)) from e
    blocks = tuple(Block(j * block_rows, min(block_rows, num_rows - j * block_rows), off)
                   for j, off in enumerate(offsets))
    return num_rows, blocks
