"""The run directory's layout has one owner, asyncrl/run_dir.py (`LAYOUT`, `RunLayout`, the checkpoint naming):
no other module under asyncrl/ spells one of its names, and what `trainer.resume=auto` moves aside is exactly
the layout's run-state entries. tests/e2e/test_train.py checks that a real run writes no other top-level name."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import asyncrl
from asyncrl import run_dir as rd
from asyncrl.run_dir import LAYOUT, RUN_STATE, RunLayout, layout_entry, prepare_run, read_record

ROOT = Path(asyncrl.__file__).resolve().parent
OWNER = "asyncrl/run_dir.py"

# (module, name) -> (how many times it spells it, why): strings that are another thing sharing the name, none of
# them a path into a run directory. Counted, so that a path spelled by hand in a listed module still fails, and
# a stale entry (the module no longer spells it so often) fails too.
EXCEPTIONS: dict[tuple[str, str], tuple[int, str]] = {
    ("asyncrl/models.py", "config.json"): (5, "a Hugging Face model dir's config: checked, and read for its model "
                                              "type and for the dtype SGLang serves it in"),
    ("asyncrl/engine/launcher.py", "config.json"): (1, "a Hugging Face model dir's config"),
    ("asyncrl/run/preflight.py", "config.json"): (2, "a Hugging Face model dir's config: checked, and read for the memory estimate"),
    ("asyncrl/testing.py", "config.json"): (1, "the tiny test model's Hugging Face config"),
    ("asyncrl/offline/checkpoints.py", "config.json"): (1, "a Hugging Face model dir's config (is_hf_dir)"),
    ("asyncrl/learner/checkpoint.py", "config.json"): (2, "the config saved inside one checkpoint directory"),
    ("asyncrl/commands/eval.py", "summary.json"): (2, "`asyncrl eval`'s own output dir, not a run dir"),
    ("asyncrl/commands/sweep.py", "summary.json"): (1, "the sweep dir's summary of its runs, not a run dir"),
    ("asyncrl/config.py", "buffer"): (1, "the config section's name"),
    ("asyncrl/config.py", "warm_start"): (1, "the config section's name"),
    ("asyncrl/cli.py", "buffer"): (1, "the `asyncrl buffer` command's name"),
    ("asyncrl/cli.py", "report"): (1, "the `asyncrl report` command's name"),
    ("asyncrl/bench/buffer.py", "buffer"): (2, "the `asyncrl buffer` command it starts"),
    ("asyncrl/commands/report.py", "buffer"): (1, "a panel's file stem inside report/ (buffer.png)"),
    ("asyncrl/bench/weights.py", "engines"): (1, "a key of the benchmark's result"),
    ("asyncrl/commands/diagnose.py", "wandb"): (1, "the package whose version it reports"),
    ("asyncrl/run/controller.py", "warm_start"): (1, "the key of the warm start's part of summary.json"),
    ("asyncrl/sft/warm_start.py", "warm_start"): (1, "the warm_start config section's key in plan.json"),
}


def owned_names() -> dict[str, str]:
    """Every string that spells a name the layout owns -> what it is: each entry's name; for a family
    (`trajectories-w*.jsonl`) also the text before its `*`, which an f-string building a member holds as a
    constant; the checkpoint naming's pieces (`step_`, `.critic`) and the aside's buffer-log name."""
    names = {}
    for e in LAYOUT:
        names[e.name] = f"the layout's {e.name!r}"
        if "*" in e.name:
            names[e.name.split("*")[0]] = f"the start of the layout's {e.name!r}"
    names[rd.CHECKPOINT_PREFIX] = "the checkpoint directory prefix"
    names[rd.CRITIC_SUFFIX] = "the critic part's suffix"
    names[rd.ASIDE_BUFFER_LOG] = "a discarded run's buffer log"
    return names


def spellings(source: str, names: dict[str, str]) -> list[tuple[int, str]]:
    """(line, string) of each string constant in `source` that spells an owned name (f-string parts included)."""
    return sorted((node.lineno, node.value) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names)


def test_no_module_but_run_dir_spells_a_name_of_the_run_directory():
    names = owned_names()
    found, counts = [], {key: 0 for key in EXCEPTIONS}
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT.parent).as_posix()
        if module == OWNER:
            continue
        for line, value in spellings(path.read_text(), names):
            if (module, value) in EXCEPTIONS:
                counts[module, value] += 1
            else:
                found.append(f"{module}:{line}: {value!r} ({names[value]}): take it from asyncrl/run_dir.py")
    assert not found, "the run directory's names are spelled outside their owner:\n" + "\n".join(found)
    off = {key: f"spelled {n} times, {EXCEPTIONS[key][0]} allowed" for key, n in counts.items()
           if n != EXCEPTIONS[key][0]}
    assert not off, f"a listed module spells a layout name another number of times than its exception allows " \
                    f"(a path spelled by hand, or a stale exception): {off}"


def test_run_dir_spells_each_name_once():
    source = (ROOT / "run_dir.py").read_text()
    counts: dict[str, int] = {}
    for _, value in spellings(source, owned_names()):
        counts[value] = counts.get(value, 0) + 1
    assert {v: n for v, n in counts.items() if n > 1} == {}
    assert len({e.name for e in LAYOUT}) == len(LAYOUT)
    assert all(e.what and "\n" not in e.what for e in LAYOUT)  # each with its one-line description


def test_run_dir_imports_only_asyncrl_util():
    """run_dir sits below config (asyncrl/config.py and asyncrl/data/group_ids.py import it): the checkpoint
    naming lives in it, asyncrl/learner/checkpoint.py takes it from there, never the reverse."""
    imported = set()
    for node in ast.walk(ast.parse((ROOT / "run_dir.py").read_text())):  # function-local imports included
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add("." * node.level + node.module)
    ours = {m for m in imported if m.startswith(("asyncrl", "."))}
    assert ours and all(m.startswith("asyncrl.util.") for m in ours), sorted(ours)


def test_the_scan_finds_a_second_spelling():
    """The scan is not vacuous: a path spelled by hand, a family member built by an f-string and a checkpoint
    name parsed by hand are all found."""
    names = owned_names()
    source = ('out / "metrics.jsonl"\nf"trajectories-w{k}.jsonl"\nf"discarded-{run_id}-{t}"\n'
              'f"step_{n:06d}"\nname.split("step_")\nsummary = "summary.json"\n"metrics.json"\n')
    assert [v for _, v in spellings(source, names)] == ["metrics.jsonl", "trajectories-w", "discarded-", "step_",
                                                        "step_", "summary.json"]


def test_entries_name_members_and_paths():
    layout = RunLayout(Path("/r"))
    assert layout.trajectories(3) == Path("/r/trajectories-w3.jsonl")
    assert layout_entry("trajectories-w3.jsonl") is rd.TRAJECTORIES and layout_entry("notes.txt") is None
    assert layout_entry("discarded-abc-2026-01-01_00-00-00") is rd.DISCARDED
    assert layout_entry("warm_start-discarded-2026-01-01_00-00-00") is rd.WARM_START_DISCARDED
    assert layout.checkpoint(12) == Path("/r/checkpoints/step_000012")
    assert rd.checkpoint_step(layout.checkpoint(12)) == 12 and rd.checkpoint_step("step_12.critic") is None
    assert rd.critic_dir(layout.checkpoint(1)).name == "step_000001.critic"
    with pytest.raises(ValueError, match="'trajectories-w\\*.jsonl' is a family of names"):
        layout.path(rd.TRAJECTORIES)
    with pytest.raises(ValueError, match="'run.json' is one name, not a family"):
        rd.RECORD.named("x")
    with pytest.raises(ValueError, match="'a/b' cannot name a member of 'discarded-\\*'"):
        rd.DISCARDED.named("a/b")
    with pytest.raises(ValueError, match="checkpoint step must be >= 0, got -1"):
        rd.checkpoint_name(-1)


def _member(e: rd.Entry) -> str:
    return e.named("0") if "*" in e.name else e.name


def test_resume_auto_moves_aside_exactly_the_layouts_run_state(tmp_path):
    """A directory holding one of every name the layout declares, left by a run that never checkpointed:
    `trainer.resume=auto` moves exactly the run-state entries aside and leaves every other name in place."""
    old = prepare_run(tmp_path, tmp_path / "buffer", "off")
    for e in LAYOUT:
        p = tmp_path / _member(e)
        if p.exists():  # the record prepare_run wrote
            continue
        if e.is_dir:
            p.mkdir()
            (p / "x").write_text(e.name)  # a non-empty buffer log, files in the rest; no checkpoint
        else:
            p.write_text(e.name)
    (tmp_path / "notes.txt").write_text("the user's own file")
    new = prepare_run(tmp_path, tmp_path / "buffer", "auto")
    assert new.resume_from is None and read_record(tmp_path).run_id == new.run_id
    [aside] = [p for p in tmp_path.glob(f"discarded-{old.run_id}-*") if p.name != _member(rd.DISCARDED)]
    moved = {p.name for p in aside.iterdir()}
    assert moved == {_member(e) for e in RUN_STATE}
    kept = {p.name for p in tmp_path.iterdir()} - {aside.name}
    assert kept == {_member(e) for e in LAYOUT if not e.run_state} | {rd.RECORD.name, "notes.txt"}
    # the files a fresh start must not inherit (each was once left behind by a hand-kept list)
    assert {"train.log", "overrides.yaml", "trajectories-w0.jsonl", "dropped_groups.jsonl", "report"} <= moved
    assert {"run.lock", "warm_start"} <= kept  # the lock is held; a warm start of the same plan is reused
    assert os.path.isdir(aside / "buffer") and (aside / "buffer" / "x").read_text() == "buffer"
