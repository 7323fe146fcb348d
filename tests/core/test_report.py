"""`asyncrl report`: plots and a summary from a run's metrics.jsonl (a real subprocess of the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.commands.report import ReportError, panel_keys, read_records, series, write_report


def _write(run, records, tail=""):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _records(n=8):
    recs = []
    for s in range(1, n + 1):
        recs.append({"step": s, "time": 10.0 * s, "train/reward_mean": s / n, "train/reward/correct": s / (2 * n),
                     "train/staleness_mean": 1.0, "train/staleness_max": 2, "learner/idle_fraction": 0.5,
                     "rollout/engine_tokens_per_s": 100.0, "learner/tokens_per_s": 50.0, "sync/seconds": 0.2,
                     "buffer/size": 10 + s, "step_seconds": 10.0, "memory/learner_peak_gb": 2.0 + s / 10,
                     "memory/driver_peak_gb": 0.5, "learner/mismatch_s0_kl_k3": 1e-4, "learner/mismatch_s1_kl_k3": 3e-3,
                     "learner/mismatch_s0_is_std": 0.01, "learner/mismatch_s1_is_std": 0.08,
                     "learner/mismatch_s0_token_frac": 0.6, "learner/mismatch_s1_token_frac": 0.4})
        if s % 4 == 0:
            recs.append({"step": s, "time": 10.0 * s, "eval/reward_mean": s / 10, "eval/pass@4": s / 8})
    return recs


def test_report_plots_every_logged_panel_and_compares_first_and_last_windows(tmp_path):
    run = tmp_path / "run"
    recs = _records()
    recs[2]["train/reward_mean"] = float("nan")  # not finite: left out of its series (json writes NaN)
    _write(run, recs, tail='{"step": 9, "train/rew')  # a torn last line (the run is still writing)
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "report", str(run), "--window", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    printed = r.stdout.split()
    names = [p.split("/")[-1] for p in printed]
    assert names == ["reward.png", "eval.png", "staleness.png", "mismatch.png", "mismatch_spread.png", "idle.png",
                     "throughput.png", "sync.png", "buffer.png", "memory.png", "summary.md"]
    for p in printed[:-1]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    md = (run / "report" / "summary.md").read_text()
    assert "8 training steps recorded (steps 1-8)." in md
    assert "| train/reward_mean | 0.1875 | 0.9375 |" in md  # steps 1-2 -> 1/8, 2/8; steps 7-8 -> 7/8, 8/8
    assert "| train/reward/correct | 0.09375 | 0.4688 |" in md
    assert "- step 4: eval/pass@4 0.5, eval/reward_mean 0.4" in md and "![reward](reward.png)" in md
    assert series(read_records(run), "train/reward_mean")[0] == [1, 2, 4, 5, 6, 7, 8]


def test_panels_a_run_never_logged_are_left_out(tmp_path):
    run = tmp_path / "run"
    _write(run, [{"step": 1, "train/reward_mean": 0.5}, {"step": 2, "train/reward_mean": 0.7}])
    paths = write_report(run)
    assert [p.name for p in paths] == ["reward.png", "summary.md"]
    assert panel_keys(read_records(run), ["eval/*"]) == []
    _write(run, _records())  # a glob in the middle: one series per staleness level, the other suffixes not
    assert panel_keys(read_records(run), ["learner/mismatch_s*_kl_k3"]) == ["learner/mismatch_s0_kl_k3",
                                                                           "learner/mismatch_s1_kl_k3"]


def test_a_dir_with_nothing_to_report_is_named(tmp_path):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        write_report(tmp_path)
    _write(tmp_path, [], tail="not json\n")
    with pytest.raises(ReportError, match="no step recorded yet"):
        write_report(tmp_path)
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "report", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no metrics.jsonl" in r.stdout
    with pytest.raises(ReportError, match="--window must be >= 1"):
        write_report(tmp_path, window=0)
