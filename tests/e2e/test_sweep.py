"""`asyncrl train -m`: a real two-point sweep on the tiny model (asyncrl/commands/sweep.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open

from tests.e2e.test_train import _overrides

pytestmark = [pytest.mark.timeout(420)]


@pytest.mark.heavy(85)
def test_a_two_point_sweep_over_the_algorithm_group_runs_grpo_and_ppo_in_their_own_dirs_and_summarizes(
        tiny_model_dir, tmp_path):
    """A sweep over a config group: one GRPO run and one PPO run (adv_estimator=gae, its critic on a rank of
    its own: algorithm.critic.placement=separate), both with LoRA adapters (model.lora.rank=4), each trained
    end to end in its own dir with a discriminative reward model (a tiny
    sequence-classification model built here, on its own Ray worker) scoring every episode before the
    buffer; the PPO run logs its critic's metrics. Both train on `env=reasoning_gym` (the optional extra's
    tasks, generated in each rollout worker, scored by the tasks' own verifiers)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    rm = tmp_path / "rm"
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.num_labels = 1
    torch.manual_seed(2)
    LlamaForSequenceClassification(cfg).save_pretrained(rm)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm)
    base = [o for o in _overrides(tiny_model_dir, tmp_path / "unused", **{
        "trainer.total_steps": 1, "reward_model.kind": "discriminative", "reward_model.path": str(rm),
        "reward_model.weight": 0.5, "trainer.dump_trajectories": 1.0, "model.lora.rank": 4,
        "algorithm.critic.placement": "separate"})
        if not o.startswith("trainer.output_dir=")]
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "-m", f"hydra.sweep.dir={sweep}", "algorithm=grpo,ppo",
           "env=reasoning_gym", *base]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["0_algorithm=grpo", "1_algorithm=ppo"]
    for name, algo, estimator in (("0_algorithm=grpo", "grpo", "grpo"), ("1_algorithm=ppo", "ppo", "gae")):
        run_cfg = json.loads((sweep / name / "config.json").read_text())
        assert run_cfg["algorithm"]["adv_estimator"] == estimator and run_cfg["model"]["lora"]["rank"] == 4
        # LoRA adapters trained; what the run exported (and synced) is the merged plain model
        assert not [k for k in safe_open(str(sweep / name / "final" / "model.safetensors"), "pt").keys() if "lora_" in k]
        run_summary = json.loads((sweep / name / "summary.json").read_text())
        assert (run_summary["exit_code"], run_summary["worker_restarts"], run_summary["engine_restarts"]) == (0, 0, 0)
        overrides = yaml.safe_load((sweep / name / "overrides.yaml").read_text())
        assert (overrides[0], overrides[-1]) == (f"algorithm={algo}", f"trainer.output_dir='{sweep / name}'")
        assert run_cfg["env"]["name"] == "reasoning_gym"
    for name in runs:  # every episode went through the reward model, none failed
        dumped = [json.loads(line) for f in sorted((sweep / name).glob("trajectories-w*.jsonl"))
                  for line in f.read_text().splitlines()]
        assert dumped and all(d["metrics"]["reward_model/failed"] == 0 for d in dumped), dumped[:1]
        assert {d["env"] for d in dumped} == {"reasoning_gym"} and all("reward/formatted" in d["metrics"] for d in dumped)
        assert all(d["reward"] == pytest.approx(d["metrics"]["reward/rule"] + 0.5 * d["metrics"]["reward/model"],
                                                abs=1e-5) for d in dumped)
    ppo = [json.loads(line) for line in (sweep / "1_algorithm=ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("critic/values_seconds", -1) >= 0 for m in ppo), ppo[-1]
    # the critic on its own rank: its part of the checkpoint beside the learner's, complete, at its first update
    critic_part = sweep / "1_algorithm=ppo" / "checkpoints" / "step_000001.critic"
    assert (critic_part / "COMPLETE").is_file()
    assert torch.load(critic_part / "meta.pt", weights_only=False)["critic_steps"] == 1
    grpo = [json.loads(line) for line in (sweep / "0_algorithm=grpo" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("critic/") for m in grpo for k in m)
    summary = json.loads((sweep / "summary.json").read_text())
    assert [(s["run"], s["exit_code"], s["steps_trained"]) for s in summary] == [
        ("0_algorithm=grpo", 0, 1), ("1_algorithm=ppo", 0, 1)]
    assert all(isinstance(s["last_reward_mean"], float) for s in summary)
    assert "| 0_algorithm=grpo | 0 | 1 |" in (sweep / "summary.md").read_text()
    assert "| 1_algorithm=ppo | 0 | 1 |" in r.stdout
    assert json.loads((sweep / "sweep.json").read_text())["runs"][1][0] == "algorithm=ppo"
