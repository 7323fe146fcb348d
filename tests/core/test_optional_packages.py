"""Packages only some features need are imported where those features run: a machine without `openai` (only
`agent.openai.function` hands its client to the user's function) or without a working `wandb` (logging is
never needed for correctness) loads every built-in plugin and logs its metrics.

Each case runs in a fresh interpreter in which importing the package fails (a None entry in sys.modules makes
`import X` raise ImportError, as on a machine where X is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _run_without(packages: list[str], body: str) -> subprocess.CompletedProcess:
    code = "import sys\n" + "".join(f"sys.modules[{p!r}] = None\n" for p in packages) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_every_builtin_plugin_loads_without_openai_and_the_function_mode_names_the_package():
    r = _run_without(["openai"], """
        from asyncrl import registry
        registry.load_entry_points()
        print("agents:", sorted(registry.names("agent")))
        from asyncrl.config import OpenAIAgentConfig
        from asyncrl.agents.openai_agent import OpenAIAgentError, check_config
        check_config(OpenAIAgentConfig(command=["python", "agent.py"]))  # the command mode needs no client
        try:
            check_config(OpenAIAgentConfig(function="my_agent"))
        except OpenAIAgentError as e:
            print("refused:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "openai_agent" in r.stdout and "tool_agent" in r.stdout
    assert "refused: agent.openai.function needs the openai package (pip install" in r.stdout


def test_metrics_are_written_when_wandb_cannot_be_imported(tmp_path):
    r = _run_without(["wandb"], f"""
        from asyncrl.metrics import MetricsLogger
        m = MetricsLogger({str(tmp_path)!r}, wandb_mode="offline", progress=False)
        m.log(1, {{"train/reward_mean": 0.5}})
        m.close()
    """)
    assert r.returncode == 0, r.stderr
    assert "wandb disabled" in r.stderr
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 1 and rec["train/reward_mean"] == 0.5
