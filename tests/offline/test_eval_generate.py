"""`asyncrl eval` and `asyncrl generate` as subprocesses over the tiny model on a real embedded engine.

The reward is a test-written function that pays 1.0 for an even-length final text, so the tiny model's
samples are a mix of successes and failures and pass@k has something to count."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from argparse import Namespace
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from asyncrl.commands import eval as eval_cli
from asyncrl.commands import generate as generate_cli

pytestmark = [pytest.mark.timeout(300)]

REWARD = '''
def even_length(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
    return {"score": 1.0 if len(final_text) % 2 == 0 else 0.0, "length": float(len(final_text))}
'''


def _args(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return [str(tiny_model_dir), "model=custom", "agent.max_turn_tokens=10", "agent.max_response_tokens=30",
            "agent.max_assistant_turns=2", "env.num_val=6", "env.num_train=7", f"env.reward.path={reward}",
            "env.reward.name=even_length", "engine.max_running_seqs=4"]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True,
                          timeout=240, **kw)


def _episodes(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]


@pytest.mark.heavy(12)
def test_eval_counts_pass_at_k_as_the_episodes_say(tiny_model_dir, tmp_path):
    out = tmp_path / "ev"
    r = _cli("eval", *_args(tiny_model_dir, tmp_path), "-k", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    eps = _episodes(out)
    by_prompt = defaultdict(list)
    for e in eps:
        by_prompt[e["data_index"]].append(e["reward"])
    assert sorted(by_prompt) == list(range(6)) and all(len(rs) == 4 for rs in by_prompt.values())
    any_success = sum(1 for rs in by_prompt.values() if max(rs) >= 1.0)
    successes = sum(1 for rs in by_prompt.values() for x in rs if x >= 1.0)
    assert 0 < successes < 24, "the even-length reward should split the samples; the test would prove nothing"
    assert summary["pass@4"] == pytest.approx(any_success / 6)
    assert summary["pass@1"] == pytest.approx(successes / 24)
    assert summary["mean@4"] == pytest.approx(successes / 24)
    assert summary["by_source"]["arithmetic"]["num_episodes"] == 24 and summary["failed_episodes"] == 0
    assert all(e["messages"][-1]["role"] == "assistant" or e["num_turns"] > 1 for e in eps)
    assert len({e["seed"] for e in eps}) == 24


@pytest.mark.heavy(12)
def test_eval_draws_are_fixed_by_the_seed(tiny_model_dir, tmp_path):
    """One episode at a time (batches of one: the same arithmetic) on a fresh engine, the same seed gives the same
    samples (in process: the session eval runs on, without the CLI around it)."""
    from asyncrl.offline.checkpoints import resolve_model_source
    from asyncrl.offline.session import agent_context, compose_config, load_split, run_rows

    args = _args(tiny_model_dir, tmp_path)
    cfg = compose_config(resolve_model_source(args[0]), args[1:])
    rows = load_split(cfg, "val", limit=2)
    passes = []
    for seed in (3, 3):  # a fresh engine each time, as each `asyncrl eval` has: bit-identical logits
        got = {}
        with agent_context(cfg, tmp_path, lambda text: None) as ctx:
            asyncio.run(run_rows(ctx, cfg.agent.name, rows, 2, seed, 1,
                                 lambda i, results: got.update({(i, r.sample_index): r.record() for r in results})))
        passes.append({k: (v["seed"], v["messages"][2:]) for k, v in got.items()})
    assert len(passes[0]) == 4 and all(not v[1] == [] for v in passes[0].values())
    assert passes[0] == passes[1]  # unseeded, two passes of a random tiny model at temperature 1 would differ


def test_eval_refuses_a_used_output_dir(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "used"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert eval_cli.main(Namespace(argv=[*_args(tiny_model_dir, tmp_path), "--out", str(out)])) == 2
    assert "not an empty directory" in capsys.readouterr().err


@pytest.mark.heavy(25)
def test_generate_resumes_after_a_kill_without_duplicating_rows(tiny_model_dir, tmp_path):
    out = tmp_path / "gen.parquet"
    parts = tmp_path / "gen.parquet.parts"
    args = ["generate", *_args(tiny_model_dir, tmp_path), "--out", str(out), "-n", "2", "--chunk-rows", "1",
            "--concurrency", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        for _line in proc.stdout:  # each status line follows a row; kill once two chunks are on disk
            if len(list(parts.glob("chunk-*.parquet"))) >= 2:
                break
        else:
            pytest.fail(f"generate ended (rc {proc.wait()}) before writing two chunks")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = {i for f in parts.glob("chunk-*.parquet") for i in pq.read_table(f).column("data_index").to_pylist()}
    assert 2 <= len(kept) < 7 and not out.exists()

    r = _cli(*args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"{len(kept)} of 7 rows already written; {7 - len(kept)} to run" in r.stdout
    table = pq.read_table(out).to_pylist()
    assert [row["data_index"] for row in table] == list(range(7))  # each row once, in order
    assert all(len(row["responses"]) == 2 and len(row["rewards"]) == 2 for row in table)
    assert all(json.loads(m)[-1]["role"] in ("assistant", "tool") for row in table for m in row["messages"])
    assert not parts.exists()

    again = _cli(*args)
    assert again.returncode == 0 and "already complete" in again.stdout


def test_generate_refuses_another_job_in_the_same_parts_dir(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "g.parquet"
    parts = tmp_path / "g.parquet.parts"
    parts.mkdir()
    (parts / "job.json").write_text(json.dumps({"model": "other", "n": 9}))
    assert generate_cli.main(Namespace(argv=[*_args(tiny_model_dir, tmp_path), "--out", str(out)])) == 2
    assert "different job" in capsys.readouterr().err
    assert generate_cli.main(Namespace(argv=[*_args(tiny_model_dir, tmp_path), "--out", str(tmp_path / "g.csv")])) == 2
    assert "must name a .parquet file" in capsys.readouterr().err


@pytest.mark.parametrize("command, sig", [("eval", signal.SIGINT), ("generate", signal.SIGTERM)])
@pytest.mark.heavy(15)
def test_a_signal_stops_eval_and_generate_with_their_engine_even_when_started_with_sigint_ignored(
        tiny_model_dir, tmp_path, command, sig):
    """A command started in the background of a script inherits SIGINT as ignored; both signals must still
    stop it, take its engine server down, say what was kept, and exit 128 + signum."""
    import psutil

    out = tmp_path / ("gen.parquet" if command == "generate" else "ev")
    args = [command, *_args(tiny_model_dir, tmp_path), "--out", str(out), "--concurrency", "1"]
    args += ["-n", "3"] if command == "generate" else ["-k", "3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    children: list = []
    try:
        for line in proc.stdout:  # a status line per finished row: the engine is up and serving
            if ("episodes (1/" if command == "eval" else "generate: 1/") in line:
                children = psutil.Process(proc.pid).children(recursive=True)
                break
        else:
            pytest.fail(f"{command} ended (rc {proc.wait()}) before finishing a row")
        assert children, "the engine server runs as a child process"
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, rest[-3000:]
    assert f"asyncrl {command}: interrupted ({sig.name})" in rest
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
