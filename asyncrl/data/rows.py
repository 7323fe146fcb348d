"""Datasets in verl's row schema: validation, reading and writing (the `asyncrl data` command is
asyncrl/commands/data.py).

A row is a mapping with
  - `prompt`: a non-empty list of chat messages `{role, content}`, role in system|user|assistant|tool,
    content a string (an assistant message that carries `tool_calls` may have null content);
  - `reward_model`: a mapping holding `ground_truth` (not null); `style`, if present, a string;
  - `data_source`, `ability`: optional strings;
  - `extra_info`: optional mapping; inside it `tools_kwargs` is a mapping {tool_name: mapping}
    and `interaction_kwargs` a mapping whose optional `name` is a string;
  - `agent_name`: optional string.
`validate_row` raises `DataError` naming the row index and the field at fault.

Files are parquet (read with pyarrow) or jsonl. Parquet stores nested mappings as struct columns,
which fill the keys a row lacks with null; `read_rows` removes those nulls inside `tools_kwargs`
and `interaction_kwargs` so a row reads back as it was written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger("asyncrl.data.rows")

ROLES = ("system", "user", "assistant", "tool")
ROW_GROUP_ROWS = 4096  # rows per parquet row group `write_rows` writes: a streamed reader decodes one at a time


class DataError(ValueError):
    """A dataset row (or file) does not follow the verl schema. `index` and `field` name the fault."""

    def __init__(self, message: str, *, index: Optional[int] = None, field: Optional[str] = None,
                 source: Optional[str] = None):
        self.index, self.field, self.source, self.message = index, field, source, message
        where = []
        if source:
            where.append(str(source))
        if index is not None:
            where.append(f"row {index}")
        if field:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


def _fail(index: int, field: str, message: str) -> None:
    raise DataError(message, index=index, field=field)


def _is_seq(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return True
    return type(x).__name__ == "ndarray"  # rows read through pandas carry numpy arrays


def validate_row(row: Any, index: int) -> None:
    """Raise DataError(index=, field=) at the first way `row` breaks the verl schema (see module doc)."""
    if not isinstance(row, Mapping):
        _fail(index, "<row>", f"a row must be a mapping, got {type(row).__name__}")
    if "prompt" not in row or row["prompt"] is None:
        _fail(index, "prompt", "missing")
    prompt = row["prompt"]
    if not _is_seq(prompt) or len(prompt) == 0:
        _fail(index, "prompt", f"must be a non-empty list of {{role, content}} messages, got {prompt!r:.80}")
    for j, msg in enumerate(prompt):
        f = f"prompt[{j}]"
        if not isinstance(msg, Mapping):
            _fail(index, f, f"a message must be a mapping, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            _fail(index, f"{f}.role", f"unknown role {role!r}; known roles: {', '.join(ROLES)}")
        content = msg.get("content")
        if content is None and not (role == "assistant" and msg.get("tool_calls")):
            _fail(index, f"{f}.content", "missing")
        if content is not None and not isinstance(content, str):
            _fail(index, f"{f}.content", f"must be a string, got {type(content).__name__}")
    rm = row.get("reward_model")
    if rm is None:
        _fail(index, "reward_model", "missing (needs reward_model.ground_truth)")
    if not isinstance(rm, Mapping):
        _fail(index, "reward_model", f"must be a mapping, got {type(rm).__name__}")
    if rm.get("ground_truth") is None:
        _fail(index, "reward_model.ground_truth", "missing")
    if rm.get("style") is not None and not isinstance(rm["style"], str):
        _fail(index, "reward_model.style", f"must be a string, got {type(rm['style']).__name__}")
    for key in ("data_source", "ability", "agent_name"):
        if row.get(key) is not None and not isinstance(row[key], str):
            _fail(index, key, f"must be a string, got {type(row[key]).__name__} {row[key]!r:.60}")
    extra = row.get("extra_info")
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        _fail(index, "extra_info", f"must be a mapping, got {type(extra).__name__}")
    tk = extra.get("tools_kwargs")
    if tk is not None:
        if not isinstance(tk, Mapping):
            _fail(index, "extra_info.tools_kwargs", f"must be a mapping {{tool_name: {{...}}}}, got {type(tk).__name__}")
        for name, kw in tk.items():
            if kw is not None and not isinstance(kw, Mapping):
                _fail(index, f"extra_info.tools_kwargs.{name}", f"must be a mapping, got {type(kw).__name__}")
    ik = extra.get("interaction_kwargs")
    if ik is not None:
        if not isinstance(ik, Mapping):
            _fail(index, "extra_info.interaction_kwargs", f"must be a mapping, got {type(ik).__name__}")
        if ik.get("name") is not None and not isinstance(ik["name"], str):
            _fail(index, "extra_info.interaction_kwargs.name", f"must be a string, got {type(ik['name']).__name__}")


def check_rows(rows: Iterable[Any]) -> tuple[list[dict], list[DataError]]:
    """Split rows into (valid rows, errors of the invalid ones), keeping order."""
    good, bad = [], []
    for i, row in enumerate(rows):
        try:
            validate_row(row, i)
        except DataError as e:
            bad.append(e)
        else:
            good.append(row)
    return good, bad


def _drop_nulls(m: Any) -> Any:
    return {k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m


def normalize_row(row: dict) -> dict:
    """Drop the nulls parquet structs add inside `tools_kwargs` / `interaction_kwargs` (see module doc)."""
    extra = row.get("extra_info")
    if isinstance(extra, Mapping):
        extra = dict(extra)
        for key in ("tools_kwargs", "interaction_kwargs"):
            if isinstance(extra.get(key), Mapping):
                extra[key] = _drop_nulls(extra[key])
        row["extra_info"] = extra
    return row


def load_file(path: str | Path) -> list[Any]:
    """The raw rows of a parquet or jsonl file, unvalidated."""
    return list(iter_file(path))


def iter_file(path: str | Path) -> Iterator[Any]:
    """The raw rows of a parquet (decoded a record batch at a time) or jsonl file, unvalidated."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"no such file (resolved to {p.resolve()})", source=str(path))
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            batches = pq.ParquetFile(p).iter_batches()
            for batch in batches:
                yield from batch.to_pylist()
        except Exception as e:
            raise DataError(f"cannot read as parquet: {e}", source=str(path)) from e
        return
    if suffix in (".jsonl", ".json"):
        n = 0
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"line {lineno} is not JSON: {e}", index=n, source=str(path)) from e
                n += 1
                yield row
        return
    raise DataError(f"unknown file type {suffix!r}; expected .parquet or .jsonl", source=str(path))


def read_rows(path: str | Path, *, skip_bad: bool = False) -> list[dict]:
    """Validated rows of a parquet or jsonl file. A bad row raises DataError (index and field), or
    with `skip_bad` is dropped and counted in a warning."""
    rows = [normalize_row(r) if isinstance(r, dict) else r for r in load_file(path)]
    good, bad = check_rows(rows)
    if bad and not skip_bad:
        e = bad[0]
        raise DataError(e.message, index=e.index, field=e.field, source=str(path)) from None
    if bad:
        log.warning("%s: skipped %d bad rows of %d (first: %s)", path, len(bad), len(rows), bad[0])
    if not good:
        raise DataError("no valid rows", source=str(path))
    return good


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as parquet (by pyarrow) or jsonl, by the file's suffix; creates parent directories.
    Rows are validated first (DataError on the first bad one)."""
    for i, row in enumerate(rows):
        validate_row(row, i)
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            table = pa.Table.from_pylist(rows)
            pq.write_table(table, p, row_group_size=ROW_GROUP_ROWS)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise DataError(f"rows cannot be stored as parquet ({e}); a field must have one type in every "
                            "row and mappings must not be empty", source=str(path)) from e
    elif suffix in (".jsonl", ".json"):
        with open(p, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise DataError(f"unknown file type {suffix!r}; expected .parquet or .jsonl", source=str(path))
    return p
