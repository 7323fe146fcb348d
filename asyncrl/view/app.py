"""`asyncrl view RUN_DIR`: a terminal UI (Textual) over a run's trajectories, live while the run writes them.

Screens:
  - the table (`TrajectoryTable`): one row per trajectory with its status (trained at step N, dropped and why,
    pending), reward and its parts, env, agent, turns, tool calls and tool errors, finish reason, staleness;
    a filter box (asyncrl/view/records.py `parse_filter`: reward>=0.5, failed, tool_errors, env=..., text);
    new lines are read every second (`live`; `p` pauses it);
  - `enter`: one trajectory (`DetailScreen`) as its conversation (system, user, assistant with its tool calls,
    tool results), then its response tokens coloured by loss mask, policy version or behaviour logprob
    (`c` cycles the colouring), or by the gap between the learner's log-prob before its step and the
    sampler's (mismatch; the summary line gives the trajectory's KL k3);
  - `g`: the samples of its group side by side (`GroupScreen`).
Everything the model wrote is shown as plain text: no markup is interpreted and control characters are shown
escaped (`safe`), so a response cannot restyle or clear the terminal.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, Optional

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from asyncrl.view.records import FilterError, RunReader, TrajRow, parse_filter

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
ROLE_STYLE = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}
VERSION_STYLES = ["green", "cyan", "magenta", "yellow", "blue", "red"]
COLOURINGS = ("mask", "version", "logprob", "mismatch")


def safe(s: Any) -> str:
    """`s` as text with control characters (ESC, BEL, CR, ...) shown as \\xNN; newlines and tabs kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(s))


def token_style(mode: str, mask: int, version: int, logprob: float, learner: Optional[float] = None) -> str:
    """The colour of one response token: inserted tokens (mask 0: tool results, scaffolding) are dim; generated
    ones are green (mask), one colour per policy version (version), red/yellow/green for behaviour
    probability < 0.1 / < 0.5 / >= 0.5 (logprob), or by how far the learner's log-prob before its step
    (`learner`; dim where the run has none) is from the sampler's: |difference| >= 0.5 red, >= 0.05 yellow,
    else green (mismatch)."""
    if not mask:
        return "dim"
    if mode == "mismatch":
        if learner is None:
            return "dim"
        gap = abs(learner - logprob)
        return "bold red" if gap >= 0.5 else "yellow" if gap >= 0.05 else "green"
    if mode == "version":
        return VERSION_STYLES[version % len(VERSION_STYLES)] if version >= 0 else "dim"
    if mode == "logprob":
        p = math.exp(logprob) if logprob <= 0 else 1.0
        return "bold red" if p < 0.1 else "yellow" if p < 0.5 else "green"
    return "green"


def conversation(row: TrajRow) -> Text:
    out = Text()
    for m in row.record.get("messages") or []:
        role = str(m.get("role", "?"))
        out.append(f"── {safe(role)}", style=f"bold {ROLE_STYLE.get(role, 'white')}")
        if m.get("name"):
            out.append(f" ({safe(m['name'])})", style="dim")
        out.append("\n")
        out.append(safe(m.get("content") or "") + "\n")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            args = fn.get("arguments")
            args = args if isinstance(args, str) else json.dumps(args, default=str)
            out.append(f"   tool call: {safe(fn.get('name'))}({safe(args)})\n", style="bold yellow")
    return out


def summary_line(row: TrajRow) -> Text:
    r = row.record
    parts = ", ".join(f"{k} {v:g}" for k, v in row.reward_parts().items())
    k3 = row.mismatch_k3()
    status = {"trained": f"trained at step {row.step} (staleness {row.staleness}"
                         + (f", sampler/learner KL k3 {k3:.2g})" if k3 is not None else ")"),
              "dropped": f"dropped at step {row.step} ({row.dropped_reason})", "pending": "not trained (yet)"}
    return Text(safe(f"{row.uid} | reward {row.reward:g}" + (f" ({parts})" if parts else "")
                     + f" | {status[row.status]} | env {r.get('env', '?')} | agent {r.get('agent', '?')} | "
                       f"{r.get('num_turns', 0)} turns | finish {r.get('finish_reason', '?')} | "
                       f"{row.tool_calls} tool calls, {row.tool_errors} errors"), style="bold")


def token_text(row: TrajRow, mode: str, decode: Optional[Callable[[int], str]]) -> Text:
    r = row.record
    ids, mask = r.get("response_ids") or [], r.get("loss_mask") or []
    versions, lps = r.get("versions") or [], r.get("behavior_logprobs") or []
    learner = row.proximal_logprobs or []
    out = Text(f"response tokens coloured by {mode} (c: next colouring)\n", style="italic")
    if not ids:
        out.append("(this record holds no tokens: written by an older asyncrl)")
        return out
    for i, tid in enumerate(ids):
        piece = decode(int(tid)) if decode is not None else f"[{tid}]"
        out.append(safe(piece), style=token_style(mode, int(mask[i]) if i < len(mask) else 0,
                                                  int(versions[i]) if i < len(versions) else -1,
                                                  float(lps[i]) if i < len(lps) else 0.0,
                                                  float(learner[i]) if i < len(learner) else None))
    return out


class DetailScreen(Screen):
    BINDINGS = [Binding("escape,q", "app.pop_screen", "back"), Binding("c", "colour", "token colouring"),
                Binding("g", "group", "group")]

    def __init__(self, row: TrajRow, decode: Optional[Callable[[int], str]]):
        super().__init__()
        self.row, self.decode, self.mode = row, decode, COLOURINGS[0]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(summary_line(self.row), id="summary")
            yield Static(conversation(self.row), id="conversation")
            yield Static(token_text(self.row, self.mode, self.decode), id="tokens")
        yield Footer()

    def action_colour(self) -> None:
        self.mode = COLOURINGS[(COLOURINGS.index(self.mode) + 1) % len(COLOURINGS)]
        self.query_one("#tokens", Static).update(token_text(self.row, self.mode, self.decode))

    def action_group(self) -> None:
        self.app.push_screen(GroupScreen(self.app.reader.group(self.row.group_id)))


class GroupScreen(Screen):
    """The samples of one group side by side: each one's reward, finish and assistant turns."""

    BINDINGS = [Binding("escape,q", "app.pop_screen", "back")]

    def __init__(self, rows: list[TrajRow]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Horizontal():
            for row in self.rows:
                t = Text(safe(f"sample {row.record.get('sample_index', '?')} | reward {row.reward:g} | "
                              f"{row.record.get('finish_reason', '?')}\n"), style="bold")
                for m in row.record.get("messages") or []:
                    if m.get("role") in ("assistant", "tool"):
                        t.append(f"── {m['role']}\n", style=ROLE_STYLE[m["role"]])
                        t.append(safe(m.get("content") or "") + "\n")
                with VerticalScroll(classes="sample"):
                    yield Static(t, classes="sample-text")
        yield Footer()


COLUMNS = ("uid", "status", "step", "reward", "parts", "env", "agent", "turns", "tools", "tool err", "finish",
           "stale", "tokens")


def table_cells(row: TrajRow) -> list[Text]:
    r = row.record
    status = row.status if row.status != "dropped" else f"dropped: {row.dropped_reason}"
    parts = " ".join(f"{k}={v:g}" for k, v in row.reward_parts().items())
    values = [row.uid, status, "" if row.step is None else row.step, f"{row.reward:.3f}", parts, r.get("env", ""),
              r.get("agent", ""), r.get("num_turns", 0), row.tool_calls, row.tool_errors or "",
              r.get("finish_reason", ""), "" if row.staleness is None else row.staleness, r.get("response_tokens", "")]
    return [Text(safe(v)) for v in values]


class ViewerApp(App):
    """The table of trajectories (see the module docstring)."""

    TITLE = "asyncrl view"
    CSS = """
    #filter { dock: top; }
    #info { dock: bottom; height: 1; }
    .sample { width: 1fr; border: solid $accent; }
    """
    BINDINGS = [Binding("q", "quit", "quit"), Binding("slash", "focus_filter", "filter"),
                Binding("g", "group", "group of the row"), Binding("p", "toggle_live", "pause/resume live"),
                Binding("escape", "focus_table", "table", show=False)]

    def __init__(self, run_dir: str, *, live: bool = True, poll_s: float = 1.0,
                 decode: Optional[Callable[[int], str]] = None):
        super().__init__()
        self.reader = RunReader(run_dir)
        self.live, self.poll_s, self.decode = live, poll_s, decode
        self.filter = parse_filter("")
        self.filter_error = ""
        self.shown: list[TrajRow] = []

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter: reward>=0.5  failed  tool_errors  trained  env=NAME  step=N  words...",
                    id="filter")
        yield DataTable(id="table", cursor_type="row", zebra_stripes=True)
        yield Static(id="info")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.reader.poll()
        self.rebuild()
        table.focus()
        self.set_interval(self.poll_s, self.tick)

    def tick(self) -> None:
        if self.live:
            self.refresh_rows()

    def refresh_rows(self) -> int:
        """Read what the run appended; rebuild the table. The number of new trajectories."""
        new = self.reader.poll()
        self.rebuild()
        return new

    def rebuild(self) -> None:
        table = self.query_one(DataTable)
        keep = table.cursor_row
        table.clear()
        self.shown = [r for r in self.reader.rows if self.filter.matches(r)]
        for r in self.shown:
            table.add_row(*table_cells(r), key=r.uid)
        if self.shown:
            table.move_cursor(row=min(max(keep, 0), len(self.shown) - 1))
        info = (f"{len(self.shown)} of {len(self.reader.rows)} trajectories | "
                f"{'live' if self.live else 'paused'} | {self.reader.run_dir}")
        if self.reader.bad_lines:
            info += f" | {self.reader.bad_lines} unreadable lines skipped"
        if self.filter_error:
            info += f" | filter: {self.filter_error}"
        self.query_one("#info", Static).update(Text(safe(info)))

    def on_input_changed(self, event: Input.Changed) -> None:
        try:
            self.filter, self.filter_error = parse_filter(event.value), ""
        except FilterError as e:
            self.filter_error = str(e)
        self.rebuild()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(DataTable).focus()

    def current(self) -> Optional[TrajRow]:
        table = self.query_one(DataTable)
        if not self.shown or table.cursor_row < 0:
            return None
        return self.shown[min(table.cursor_row, len(self.shown) - 1)]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        row = self.reader.by_uid.get(str(event.row_key.value))
        if row is not None:
            self.push_screen(DetailScreen(row, self.decode))

    def action_group(self) -> None:
        row = self.current()
        if row is not None:
            self.push_screen(GroupScreen(self.reader.group(row.group_id)))

    def action_toggle_live(self) -> None:
        self.live = not self.live
        self.rebuild()

    def action_focus_filter(self) -> None:
        self.query_one(Input).focus()

    def action_focus_table(self) -> None:
        self.query_one(DataTable).focus()
