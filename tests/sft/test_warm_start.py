"""`asyncrl train`'s warm start (asyncrl/sft/warm_start.py): demonstrations, SFT, then RL from that model.

The end-to-end test runs a real `asyncrl train` subprocess on the tiny model; the rest call the warm start
in process on the same tiny model (real demonstrations through the agent loop, real SFT steps)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.envs.base import resolve_env
from asyncrl.run import controller
from asyncrl.run.preflight import PreflightError, preflight
from asyncrl.run_dir import RunRecord, RunStart
from asyncrl.sft import trainer
from asyncrl.sft.warm_start import WarmStartError, run_warm_start, why_not

pytestmark = pytest.mark.timeout(420)

TEMPLATES = Path(__file__).parents[1] / "agents" / "chat_templates"


def _overrides(model_dir: Path, out: Path, **extra: object) -> list[str]:
    base = {
        "model": "custom", "model.path": str(model_dir), "trainer.output_dir": str(out),
        "warm_start.mode": "on", "warm_start.demos": 4, "warm_start.epochs": 40, "warm_start.batch": 4,
        "warm_start.lr": 3e-3, "env.num_train": 4, "env.num_val": 2, "agent.max_turn_tokens": 48,
        "agent.max_response_tokens": 160, "agent.max_assistant_turns": 2, "trainer.wandb": "off",
        "trainer.progress": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _cfg(model_dir: Path, out: Path, **extra: object):
    return load_config(_overrides(model_dir, out, **extra))


@pytest.mark.heavy(55)
def test_a_run_fine_tunes_on_demonstrations_then_its_engines_sample_the_fine_tuned_policy(tiny_model_dir, tmp_path):
    """The silent failure to rule out: RL that keeps sampling the base model. The random tiny model never
    writes a tool call; after the warm start (40 epochs on the 4 training rows' demonstrations) the engines'
    version-0 episodes, near-greedy, say what the demonstrations say."""
    out = tmp_path / "run"
    args = _overrides(tiny_model_dir, out, **{
        "trainer.total_steps": 1, "trainer.batch_groups": 2, "algorithm.n_samples": 2, "algorithm.max_staleness": 1,
        "agent.sampling.temperature": 0.05, "engine.max_running_seqs": 8, "algorithm.micro_batch_tokens": 2048,
        "ray.num_cpus": 4})
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", *args], capture_output=True, text=True,
                         timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    done = json.loads((out / "warm_start" / "done.json").read_text())
    assert done["demos"] == 4 and done["rejected"] == 0 and done["sft_steps"] == 40
    assert done["model"] == str(out / "warm_start" / "final")
    assert json.loads((out / "summary.json").read_text())["warm_start"] == done
    assert json.loads((out / "config.json").read_text())["model"]["path"] == done["model"]
    sft_records = [json.loads(x) for x in (out / "warm_start" / "metrics.jsonl").read_text().splitlines()]
    sft_losses = [r["sft/train_loss"] for r in sft_records]
    assert len(sft_losses) == 40 and sft_losses[-1] < 0.2 * sft_losses[0]
    demos = [json.loads(x) for x in (out / "warm_start" / "demos-train.jsonl").read_text().splitlines() if x]
    assert all("I will compute it with the calculator." in d["messages"][1]["content"] for d in demos)
    episodes = [json.loads(x) for p in out.glob("trajectories-w*.jsonl") for x in p.read_text().splitlines() if x]
    first = [e for e in episodes if e["min_version"] == 0]
    assert first, "no episode of the warm-started policy (version 0) was written"
    # After 40 steps the 64-wide model is still at a loss near 1.4: its near-greedy samples mix the demonstrations'
    # pieces, and which piece comes first varies with the CPU's rounding. Every sample writes the tool's name (the
    # demonstrations write it in each turn; the random base model has no chance to), and the demonstrations'
    # sentence is said whole in the batch.
    said = [next(m["content"] for m in e["messages"] if m["role"] == "assistant") for e in first]
    assert all("calculator" in s for s in said), said
    assert any("I will compute it with the calculator." in s for s in said), said
    assert "warm start:" in res.stdout + res.stderr
    # the warm start ran in a child of the driver (asyncrl/util/isolated.py): its lines are in the run's
    # console record all the same, and the run's summary names each role's peak memory
    assert "warm start: 4 demonstrations" in (out / "train.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    # the warm start's peak is its largest step's, though each step starts the process's peak again (done.json
    # keeps 3 decimals)
    assert done["peak_rss_gb"] >= round(max(r["memory/learner_peak_gb"] for r in sft_records), 3) > 0
    assert {"driver_peak_gb", "learner_peak_gb", "engine_peak_gb", "rollout_rss_gb"} <= set(summary["memory"])
    assert all(v > 0 for v in summary["memory"].values()), summary["memory"]
    assert "peak resident memory (GiB): driver" in res.stdout


def test_preflight_refuses_a_warm_start_that_cannot_run_and_says_when_auto_runs_none(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, agent="react")
    with pytest.raises(PreflightError) as e:
        preflight(cfg)
    assert any(p.startswith("warm_start.mode=on: agent=react: demonstrations are played through tool_agent")
               for p in e.value.problems), e.value.problems
    report = preflight(_cfg(tiny_model_dir, tmp_path, agent="react", **{"warm_start.mode": "auto"}))
    assert "warm start: none" in report.summary()
    assert any(w.startswith("no warm start (warm_start.mode=auto): agent=react") for w in report.warnings)
    report = preflight(_cfg(tiny_model_dir, tmp_path, **{"warm_start.mode": "auto"}))  # a model of one's own
    assert "warm start: none" in report.summary()
    assert report.warnings[-1] == (f"no warm start (warm_start.mode=auto): model.path={tiny_model_dir} is set (a "
                                   "model of your own; warm_start.mode=on fine-tunes it on demonstrations first); "
                                   "RL starts from the configured model as it is")
    assert run_warm_start(_cfg(tiny_model_dir, tmp_path, **{"warm_start.mode": "auto"}), resolve_env("arithmetic"),
                          [], tmp_path, resuming_rl=False) is None
    report = preflight(_cfg(tiny_model_dir, tmp_path))
    assert "warm start: SFT on demonstrations of the first 4 training rows (40 epoch(s), lr 0.003" in report.summary()


def test_preflight_refuses_a_warm_start_whose_tool_parser_cannot_render(tiny_model_dir, tmp_path, plugin_registry):
    """A tool_parser plugin with parse only runs RL, but cannot write demonstrations: the preflight names it."""
    plugin = tmp_path / "parse_only.py"
    plugin.write_text("from asyncrl.agents.parsers import HermesParser\nfrom asyncrl.registry import register\n\n\n"
                      "@register('tool_parser', 'parse_only')\nclass ParseOnly:\n    def parse(self, text):\n"
                      "        return HermesParser().parse(text)\n")
    extra = {"plugins": f"[{plugin}]", "agent.tool_parser": "parse_only"}
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(tiny_model_dir, tmp_path, **extra))
    [problem] = [p for p in e.value.problems if p.startswith("warm_start.mode=on: ")]
    assert problem.startswith(f"warm_start.mode=on: agent.tool_parser=parse_only is the tool_parser plugin ParseOnly "
                              f"(config {plugin}), which has no render(content, calls)"), problem
    assert "set agent.tool_parser to one that has it: deepseek_v3, hermes, llama3_json" in problem, problem
    report = preflight(_cfg(tiny_model_dir, tmp_path, **extra, **{"warm_start.mode": "auto"}))
    assert report.warnings[-1].startswith("no warm start (warm_start.mode=auto): agent.tool_parser=parse_only is "
                                          "the tool_parser plugin "), report.warnings
    assert "warm start: none" in preflight(_cfg(tiny_model_dir, tmp_path, **extra, **{"warm_start.mode": "off"})).summary()


def test_a_warm_start_in_llamas_format_demonstrates_and_trains_in_it(tiny_model_dir, tmp_path):
    """agent.tool_parser=llama3_json on a model whose chat template is Llama 3.1's: the preflight lets the warm
    start run, the demonstrations are written (by the parser's render) and played in Llama's JSON call format,
    and SFT trains on them."""
    model = tmp_path / "llama-template-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text((TEMPLATES / "llama3_1.jinja").read_text())
    out = tmp_path / "run"
    cfg = _cfg(model, out, **{"warm_start.epochs": 1, "agent.tool_parser": "llama3_json"})
    assert "warm start: SFT on demonstrations of the first 4 training rows" in preflight(cfg).summary()
    warm = _warm(cfg, out)
    assert (warm.summary["demos"], warm.summary["rejected"], warm.summary["sft_steps"]) == (4, 0, 1)
    rows = resolve_env("arithmetic").build(cfg.env, "train")
    demos = [json.loads(x) for x in (out / "warm_start" / "demos-train.jsonl").read_text().splitlines() if x]
    for d in demos:
        said = d["agent_messages"][2]["content"]  # the first assistant turn as the agent loop recorded it
        expr = rows[d["data_index"]]["extra_info"]["expression"]
        assert json.loads(said) == {"name": "calculator", "parameters": {"expression": expr}}, said
    assert (warm.model / "config.json").exists()


def test_an_env_without_demonstrations_is_named_and_bad_settings_are_refused_at_load(tiny_model_dir, tmp_path):
    from asyncrl.envs.base import Env

    class NoDemos(Env):
        name = "no_demos_env"

    cfg = _cfg(tiny_model_dir, tmp_path)
    assert why_not(cfg, NoDemos()) == "env 'no_demos_env' has no demonstrations (it does not implement demo_turns)"
    assert why_not(cfg, resolve_env("arithmetic")) is None
    with pytest.raises(ValueError, match="warm_start.demos: must be >= 1, got 0"):
        _cfg(tiny_model_dir, tmp_path, **{"warm_start.demos": 0})
    with pytest.raises(ValueError, match="warm_start.lr: must be a positive number, got nan"):
        _cfg(tiny_model_dir, tmp_path, **{"warm_start.lr": "nan"})


def in_process(fn, cfg, rows, out, resuming_rl, secrets, name):
    """`controller._warm_start`'s runner for the tests of its decisions: the warm start in this process, where
    a test's monkeypatches reach it (the run's own runner starts a child process: asyncrl/util/isolated.py)."""
    return run_warm_start(cfg, resolve_env(cfg.env.name), rows, out, resuming_rl)


def _warm(cfg, out: Path, resuming_rl: bool = False):
    env = resolve_env(cfg.env.name)
    return run_warm_start(cfg, env, env.build(cfg.env, "train"), out, resuming_rl=resuming_rl)


def test_a_finished_warm_start_is_reused_and_another_plans_is_moved_aside(tiny_model_dir, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model_dir, tmp_path, **{"warm_start.epochs": 1})
    first = _warm(cfg, tmp_path)
    assert first.model == tmp_path / "warm_start" / "final" and (first.model / "config.json").exists()

    def no_training(*a, **k):
        raise AssertionError("a finished warm start was trained again")

    monkeypatch.setattr(trainer, "train", no_training)
    assert _warm(_cfg(tiny_model_dir, tmp_path, **{"warm_start.epochs": 1}), tmp_path) == first
    monkeypatch.undo()
    second = _warm(_cfg(tiny_model_dir, tmp_path, **{"warm_start.epochs": 2}), tmp_path)
    assert second.summary["sft_steps"] == 2
    aside = list(tmp_path.glob("warm_start-discarded-*"))
    assert len(aside) == 1 and json.loads((aside[0] / "done.json").read_text())["sft_steps"] == 1
    # a resumed RL run whose directory has no finished warm start keeps its checkpoint's policy
    assert _warm(cfg, tmp_path / "elsewhere", resuming_rl=True) is None
    assert not (tmp_path / "elsewhere" / "warm_start").exists()


def test_an_interrupted_warm_start_ends_the_run_with_a_summary_and_resumes_its_sft(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    from asyncrl.learner.worker import LearnerWorker

    cfg = _cfg(tiny_model_dir, tmp_path, **{"warm_start.batch": 1, "warm_start.epochs": 1})
    calls = {"n": 0}
    original = LearnerWorker.train_step

    def interrupted_at_step_3(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(LearnerWorker, "train_step", interrupted_at_step_3)
    # SFT keeps no checkpoint before its end unless asked: resume then starts SFT again from step 0
    start = RunStart("run00001", RunRecord(run_id="run00001", created=0.0), None)
    env = resolve_env("arithmetic")
    rows = env.build(cfg.env, "train")
    warm, code = controller._warm_start(cfg, rows, tmp_path, start, {}, runner=in_process)
    assert (warm, code) == (None, 128 + signal.SIGINT)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_reason"].startswith("interrupted (SIGINT) during the warm start")
    assert not (tmp_path / "warm_start" / "done.json").exists()
    monkeypatch.setattr(LearnerWorker, "train_step", original)
    # resumed as a run does: in a child process of its own, whose answer sets the policy RL starts from
    warm, code = controller._warm_start(cfg, rows, tmp_path, start, {})
    assert code is None and warm.summary["sft_steps"] == 4 and cfg.model.path == str(tmp_path / "warm_start" / "final")


def test_a_warm_start_that_keeps_no_demonstration_fails_the_run_naming_why(tiny_model_dir, tmp_path, monkeypatch):
    from asyncrl.envs.base import DemoTurn

    env = resolve_env("arithmetic")
    monkeypatch.setattr(type(env), "demo_turns", lambda self, row: [DemoTurn("Answer: -12345")])
    cfg = _cfg(tiny_model_dir, tmp_path)
    with pytest.raises(WarmStartError, match=r"none of the first 4 training rows of env 'arithmetic' gave a "
                                             r"demonstration .*earned reward"):
        run_warm_start(cfg, env, env.build(cfg.env, "train"), tmp_path, resuming_rl=False)
    start = RunStart("run00001", RunRecord(run_id="run00001", created=0.0), None)
    warm, code = controller._warm_start(cfg, env.build(cfg.env, "train"), tmp_path, start, {}, runner=in_process)
    assert code == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_reason"] == "the warm start failed" and "set warm_start.mode=off" in summary["diagnosis"]
