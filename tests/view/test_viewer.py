"""`asyncrl view`, driven headlessly with Textual's pilot over a run dir whose files the real writers wrote.

The trajectories come from the real tool_agent (calculator calls that really run) over the ScriptedEngine
TEST DOUBLE (no model could be made to call a tool on cue), written by the rollout worker's TrajectoryLog; the
trained and dropped records are in the controller's and fleet's formats."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import msgspec
import pytest
from textual.widgets import DataTable, Input, Static

from asyncrl.agents.base import run_episode
from asyncrl.rollout.trajectory_log import TrajectoryLog, trajectory_record
from asyncrl.view.app import DetailScreen, GroupScreen, ViewerApp, safe
from asyncrl.view.records import FilterError, RunReader, parse_filter
from tests.agents.helpers import call, make_ctx, make_sample
from tests.agents.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(120)

HOSTILE = "[red]boom[/red] \x1b[2J\x1b]0;owned\x07 Answer: 3"


async def _traj(tokenizer, script, uid, group, sample_index, tools=None):
    engine = ScriptedEngine(tokenizer, script, versions_by_turn=[0, 1, 1])
    ctx, _ = make_ctx(tokenizer, engine, tools=tools, max_turn_tokens=64, max_response_tokens=400)
    sample = dataclasses.replace(make_sample(), uid=uid, group_id=group, sample_index=sample_index, group_size=2)
    return await run_episode(sample, ctx, "tool_agent")


async def _run_dir(tmp_path, tokenizer):
    log = TrajectoryLog(tmp_path, worker_id=0, fraction=1.0, seed=0)
    solved = await _traj(tokenizer, ["Let me compute. " + call("calculator", {"expression": "3*4+5"}),
                                     "The result is 17.\nAnswer: 17"], "r-g0-0", "r-g0", 0)
    hostile = await _traj(tokenizer, [HOSTILE], "r-g0-1", "r-g0", 1)
    broken = await _traj(tokenizer, [call("nosuchtool", {"x": 1}), "Answer: 1"], "r-g1-0", "r-g1", 0)
    for t in (solved, hostile, broken):
        log.write(t)
    (tmp_path / "trained_uids.jsonl").write_text(json.dumps({"step": 4, "version": 3, "uids": ["r-g0-0", "r-g0-1"]})
                                                 + "\n")
    (tmp_path / "dropped_groups.jsonl").write_text(json.dumps({"step": 5, "group_id": "r-g1", "reason": "stale"})
                                                   + "\n")
    # the learner's log-probs of r-g0-0's tokens (the controller's format): every other one 0.7 off the sampler's
    behav = trajectory_record(solved)["behavior_logprobs"]
    learner = [b + 0.7 if i % 2 == 0 else b for i, b in enumerate(behav)]
    (tmp_path / "learner_logprobs.jsonl").write_text(
        json.dumps({"step": 4, "uid": "r-g0-0", "proximal_logprobs": learner}) + "\n"
        + json.dumps({"step": 4, "uid": "r-g0-1", "proximal_logprobs": ["x"]}) + "\n")  # malformed: skipped
    return solved, hostile, broken


async def test_table_filters_detail_group_and_live(tmp_path, tokenizer):
    solved, _, _ = await _run_dir(tmp_path, tokenizer)
    app = ViewerApp(str(tmp_path), decode=lambda i: tokenizer.decode([i]), poll_s=3600)
    async with app.run_test(size=(200, 60)) as pilot:
        table = app.query_one(DataTable)
        assert table.row_count == 3
        cells = {str(table.get_row_at(i)[0]): [str(c) for c in table.get_row_at(i)] for i in range(3)}
        assert cells["r-g0-0"][1:4] == ["trained", "4", "1.000"] and cells["r-g0-0"][11] == "3"  # staleness 3 - 0
        assert cells["r-g1-0"][1] == "dropped: stale" and cells["r-g1-0"][9] == "1"  # one tool error

        for text, expect in [("reward>=1", {"r-g0-0"}), ("tool_errors", {"r-g1-0"}), ("dropped", {"r-g1-0"}),
                             ("trained reward<1", {"r-g0-1"}), ("boom", {"r-g0-1"}), ("step=4 compute", {"r-g0-0"}),
                             ("", {"r-g0-0", "r-g0-1", "r-g1-0"})]:
            app.query_one(Input).value = text
            await pilot.pause()
            assert {str(table.get_row_at(i)[0]) for i in range(table.row_count)} == expect, text

        table.focus()
        table.move_cursor(row=[str(table.get_row_at(i)[0]) for i in range(3)].index("r-g0-0"))
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        talk = app.screen.query_one("#conversation", Static).content.plain
        assert "tool call: calculator" in talk or '"name": "calculator"' in talk
        assert "── tool" in talk and "\n17\n" in talk  # the calculator's result, as the tool turn
        tokens = app.screen.query_one("#tokens", Static).content
        assert "coloured by mask" in tokens.plain and "Answer: 17" in tokens.plain
        styles = {str(s.style) for s in tokens.spans}
        assert {"green", "dim"} <= styles  # generated and inserted (the tool result) tokens
        await pilot.press("c")
        tokens = app.screen.query_one("#tokens", Static).content
        assert "coloured by version" in tokens.plain and {"green", "cyan"} <= {str(s.style) for s in tokens.spans}
        await pilot.press("c", "c")  # by the learner's log-prob against the sampler's
        tokens = app.screen.query_one("#tokens", Static).content
        assert "coloured by mismatch" in tokens.plain and {"green", "bold red", "dim"} <= {str(s.style) for s in tokens.spans}
        assert "sampler/learner KL k3" in app.screen.query_one("#summary", Static).content.plain
        await pilot.press("c")  # back to the first colouring
        await pilot.press("g")
        assert isinstance(app.screen, GroupScreen)
        assert app.reader.bad_lines == 1  # the malformed learner line
        samples = [s.content.plain for s in app.screen.query(".sample-text").results(Static)]
        assert len(samples) == 2 and "reward 1" in samples[0] and "boom" in samples[1]
        await pilot.press("escape")
        await pilot.press("escape")
        assert app.screen is app.screen_stack[0]

        # live: a line the run appends shows up at the next tick; a torn line waits for its newline
        line = json.dumps(trajectory_record(msgspec.structs.replace(solved, uid="r-g2-0", group_id="r-g2")))
        with open(tmp_path / "trajectories-w0.jsonl", "a") as f:
            f.write(line[:40])
        app.tick()
        await pilot.pause()
        assert table.row_count == 3
        with open(tmp_path / "trajectories-w0.jsonl", "a") as f:
            f.write(line[40:] + "\n")
        await pilot.press("p")  # paused: nothing new is read
        app.tick()
        await pilot.pause()
        assert table.row_count == 3
        await pilot.press("p")
        app.tick()
        await pilot.pause()
        assert table.row_count == 4


async def test_model_text_cannot_restyle_or_control_the_terminal(tmp_path, tokenizer):
    await _run_dir(tmp_path, tokenizer)
    app = ViewerApp(str(tmp_path), decode=lambda i: tokenizer.decode([i]), poll_s=3600)
    async with app.run_test(size=(200, 60)) as pilot:
        app.query_one(Input).value = "boom"
        await pilot.pause()
        app.query_one(DataTable).focus()
        await pilot.press("enter")
        talk = app.screen.query_one("#conversation", Static).content
        assert "[red]boom[/red]" in talk.plain  # shown as written, not as markup
        assert "\\x1b[2J" in talk.plain and "\\x07" in talk.plain and "\x1b" not in talk.plain
        assert not any("red" in str(s.style) for s in talk.spans)


def test_reader_skips_bad_lines_and_waits_for_torn_ones(tmp_path):
    f = tmp_path / "trajectories-w3.jsonl"
    f.write_text('{"uid": "a", "group_id": "g", "reward": 1}\nnot json\n[1, 2]\n{"uid": "b", "gro')
    r = RunReader(tmp_path)
    assert r.poll() == 1 and r.bad_lines == 2 and [x.uid for x in r.rows] == ["a"]
    with open(f, "a") as fh:
        fh.write('up_id": "g", "reward": 0}\n{"uid": "a", "group_id": "g"}\n')  # a repeated uid is not a new row
    assert r.poll() == 1 and [x.uid for x in r.rows] == ["a", "b"] and r.rows[1].status == "pending"
    with pytest.raises(FileNotFoundError, match="no such directory"):
        RunReader(tmp_path / "missing")


@pytest.mark.parametrize("bad", ["reward>abc", "reward=>1", "reward<"])
def test_filter_refuses_malformed_comparisons(bad):
    with pytest.raises(FilterError, match="expected reward"):
        parse_filter(bad)


def test_safe_shows_control_characters():
    assert safe("a\x1b[2Jb\tc\nd\x00\x9b") == "a\\x1b[2Jb\tc\nd\\x00\\x9b"


async def test_print_mode_lists_the_rows(tmp_path, tokenizer):
    await _run_dir(tmp_path, tokenizer)
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "view", str(tmp_path), "--print", "--filter", "trained"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("uid\tstatus") and sorted(x.split("\t")[0] for x in lines[1:]) == ["r-g0-0", "r-g0-1"]
    assert "\x1b" not in r.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "view", str(tmp_path / "nope")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "no such directory" in bad.stderr


def test_mismatch_k3_is_zero_when_learner_and_sampler_agree_and_counts_generated_tokens_only():
    from asyncrl.view.records import TrajRow

    rec = {"behavior_logprobs": [-1.0, -2.0, -0.5], "loss_mask": [1, 0, 1]}
    assert TrajRow(rec, proximal_logprobs=[-1.0, -9.0, -0.5]).mismatch_k3() == 0.0  # the masked token is not counted
    k3 = TrajRow(rec, proximal_logprobs=[-0.5, -2.0, -0.5]).mismatch_k3()
    assert k3 == pytest.approx((math.expm1(0.5) - 0.5) / 2)
    assert TrajRow(rec).mismatch_k3() is None and TrajRow(rec, proximal_logprobs=[0.0]).mismatch_k3() is None
