"""scripts/gpu_run.sh, the GPU run prepared as one script, checked for its stages' wiring on a CPU (DRY_RUN=1):
every stage's command line passes the real parsers, config validation and preflight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy(10)
def test_the_gpu_script_stages_are_wired(tiny_model_dir, tmp_path):
    out = tmp_path / "gpu"
    model = [f"model.path={tiny_model_dir}", "model=custom"]
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, EVAL_ARGS="--limit 2 " + " ".join(model))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), str(out), *model], capture_output=True,
                       text=True, timeout=240, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    # the two engine benches at 16 and 128 rows, printed; train and eval checked by their own --dry-run
    assert any("bench_engine_16 (dry run)" in x and "--batch 16" in x for x in lines)
    assert any("bench_engine_128 (dry run)" in x and "--batch 128" in x for x in lines)
    assert "== train: exit 0" in r.stdout and "== eval_base: exit 0" in r.stdout
    train_log = (out / "train.log").read_text()
    assert "preflight passed; nothing started (--dry-run)" in train_log
    assert "agent: tool_agent" in train_log and "tools: calculator" in train_log  # the default task
    assert '"dry_run": true' in (out / "eval_base.log").read_text()
    assert not (out / "run").exists()  # nothing was started
    # the SGLang stage: this .venv has no sglang, and the script says so instead of failing or staying silent
    assert "== sglang: not run: sglang does not import in" in r.stdout and "ModuleNotFoundError" in r.stdout
    assert (out / "sglang.log").read_text().startswith("== sglang: not run")
