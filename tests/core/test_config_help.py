"""Every config field carries its description as data (`setting(default, "description")` in asyncrl/config.py),
no field line hides one in a trailing comment, and `asyncrl train --help` shows exactly that data."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from pathlib import Path

from asyncrl import config
from asyncrl.commands.train_help import COMMON_KEYS, describe, key_fields
from asyncrl.config import describe_field


def config_dataclasses() -> list[type]:
    """Every dataclass defined in asyncrl.config (ToolSpec and InteractionSpec too, which sit inside lists)."""
    return [cls for _, cls in inspect.getmembers(config, dataclasses.is_dataclass)
            if isinstance(cls, type) and cls.__module__ == config.__name__]


def field_line_comments(source: str) -> list[tuple[str, str, int, str]]:
    """(class, field, line, comment) for each comment on the lines of a dataclass field's declaration
    (a field's line, or any line of a declaration that spans several)."""
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1):
                    if line in comments:
                        found.append((node.name, stmt.target.id, line, comments[line]))
    return found


def test_the_module_defines_the_sections_found_only_inside_lists():
    names = {cls.__name__ for cls in config_dataclasses()}
    assert {"Config", "ToolSpec", "InteractionSpec", "WeightSyncConfig"} <= names


def test_every_field_of_every_config_dataclass_has_a_description():
    missing = [f"{cls.__name__}.{f.name}" for cls in config_dataclasses() for f in dataclasses.fields(cls)
               if not describe_field(f).strip()]
    assert not missing, f"fields without a description in asyncrl/config.py: {missing}"


def test_no_field_line_of_config_py_carries_a_trailing_comment():
    found = field_line_comments(Path(config.__file__).read_text())
    assert not found, f"descriptions are data (setting(default, '...')), not comments: {found}"


def test_the_trailing_comment_check_finds_one():
    snippet = (
        "@dataclass\n"
        "class S:\n"
        "    # a comment above a field is not on its line\n"
        '    a: int = setting(1, "described")\n'
        "    b: int = setting(2, '')  # the description, hidden in a comment\n"
        "    c: str = setting(\n"
        "        'x', '')  # on the last line of a field that spans two\n"
        "    def f(self) -> None:\n"
        "        pass  # code, not a field\n"
    )
    found = field_line_comments(snippet)
    assert [(cls, name, line) for cls, name, line, _ in found] == [("S", "b", 5), ("S", "c", 7)]
    assert found[0][3] == "# the description, hidden in a comment"


def test_train_help_shows_exactly_each_keys_field_description():
    fields = key_fields()
    rows = describe()
    assert [key for key, _, _ in rows] == list(COMMON_KEYS)
    for key, _, text in rows:
        assert text == describe_field(fields[key]) != "", key
    # a key outside the common table too, whose description was written with the field
    [(_, default, text)] = describe(("engine.launch_timeout_s",))
    assert default == 300.0
    assert text == describe_field(next(f for f in dataclasses.fields(config.EngineConfig)
                                       if f.name == "launch_timeout_s"))
    assert text.startswith("seconds a launched engine may take")
