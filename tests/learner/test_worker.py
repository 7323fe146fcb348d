"""LearnerWorker on the real tiny model: logprob alignment, packing, FSDP2 ranks, checkpoints, export."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.data.schema import Batch, Group, make_trajectory
from asyncrl.engine.sampling import token_logprobs
from asyncrl.learner.checkpoint import CheckpointError
from asyncrl.learner.packing import specs_of
from tests.learner.helpers import make_batch, make_cfg

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker

    return LearnerWorker(make_cfg(tiny_model_dir, minibatches=2, epochs=1))


def _specs(batch):
    return specs_of(batch.trajectories())[0]


@pytest.mark.timeout(120)
def test_logprobs_token_by_token_against_separate_forwards(worker):
    """Response token i is scored from position P + i - 1 with log_softmax(logits / 0.7) (the engine's T)."""
    batch = make_batch(seed=5)
    specs = _specs(batch)
    got = worker._score(worker.model, specs, list(range(len(specs))))
    with torch.no_grad():
        for i, s in enumerate(specs):
            logits = worker.model(input_ids=s.input_ids[None]).logits[0]
            for j in range(s.loss_mask.numel()):
                want = token_logprobs(logits[s.prompt_len + j - 1], s.input_ids[s.prompt_len + j], 0.7)
                want = want.item() if s.loss_mask[j] else 0.0
                assert got[i][j].item() == pytest.approx(want, abs=1e-5), (i, j)


def _on_policy_batch(worker, seed=7):
    """A batch whose behavior logprobs are the model's own (what the engine would have reported)."""
    batch = make_batch(seed=seed)
    specs = _specs(batch)
    lp = worker._score(worker.model, specs, list(range(len(specs))))
    groups = []
    for g in batch.groups:
        trajs = []
        for t in g.trajectories:
            i = batch.trajectories().index(t)
            trajs.append(make_trajectory(
                uid=t.uid, group_id=t.group_id, prompt_ids=t.prompt_ids.numpy().tolist(),
                response_ids=t.response_ids.numpy().tolist(), loss_mask=t.loss_mask.numpy().tolist(),
                behavior_logprobs=lp[i].tolist(), versions=t.versions.numpy().tolist(), reward=t.reward))
        groups.append(Group(group_id=g.group_id, trajectories=trajs, expected=len(trajs)))
    return Batch(batch_id=batch.batch_id, groups=groups)


@pytest.mark.timeout(120)
def test_train_step_on_policy_batch(worker):
    batch = _on_policy_batch(worker)
    before = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    v0 = worker.version
    m = worker.train_step(batch)
    assert worker.version == v0 + 1 and m["learner/version"] == worker.version
    # proximal == behavior up to fp32 rounding of two layouts: weights 1, KL 0
    assert m["learner/is_mean"] == pytest.approx(1.0, abs=1e-4) and m["learner/is_kl_k3"] == pytest.approx(0, abs=1e-6)
    assert m["learner/is_frac_truncated"] == 0 and m["learner/is_frac_rejected"] == 0
    # by staleness: every token of the batch has one version, so one level (the shared worker's version may
    # have moved in earlier tests), with no mismatch
    s = min(min(v0 - min(t.versions.numpy()) for t in batch.trajectories()), worker.algo.max_staleness)
    assert {k for k in m if k.startswith("learner/mismatch_s")} == {
        f"learner/mismatch_s{s}_kl_k3", f"learner/mismatch_s{s}_is_std", f"learner/mismatch_s{s}_token_frac"}
    assert m[f"learner/mismatch_s{s}_token_frac"] == 1 and m[f"learner/mismatch_s{s}_kl_k3"] == pytest.approx(0, abs=1e-6)
    assert m["learner/tokens"] == sum(int(t.loss_mask.numpy().sum()) for t in batch.trajectories())
    assert m["learner/optimizer_steps"] == 2 and m["learner/grad_norm"] > 0
    assert m["learner/lr"] == pytest.approx(1e-3)
    # the first minibatch's update starts at the proximal weights: ratio 1 there, so no clipping at all
    assert m["learner/clip_frac"] == 0
    changed = [k for k, v in worker.model.named_parameters() if not torch.equal(v, before[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and len(changed) == len(before)


@pytest.mark.timeout(120)
def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(worker):
    from asyncrl.learner.advantages import compute_advantages, group_index

    batch = make_batch(seed=11, groups=4, per_group=3, prompt=(1, 6), response=(1, 14), shared_prompt=True)
    trajs = batch.trajectories()
    specs = _specs(batch)
    behav = [torch.from_numpy(t.behavior_logprobs.numpy().copy()) for t in trajs]
    masks = [s.loss_mask for s in specs]
    adv = compute_advantages("grpo", [t.reward for t in trajs], group_index([t.group_id for t in trajs]))
    idx = list(range(len(trajs)))
    layout = worker.layout
    assert layout.share_prompts  # the default, with the tiny model's sdpa attention
    prox = worker._score(worker.model, specs, idx)
    results = {}
    # (packing, share_prompts, token budget)
    configs = ((True, False, 40), (False, False, 40), (True, False, 10_000), (False, False, 10_000),
               (True, True, 40), (True, True, 10_000))
    for packing, share, budget in configs:
        worker.layout = replace(layout, packing=packing, share_prompts=share, token_budget=budget)
        sums, _, compute = worker._minibatch_update(idx, specs, behav, masks, adv, prox, None)
        grads = {k: p.grad.clone() for k, p in worker.model.named_parameters()}
        results[(packing, share, budget)] = (float(sums[0]), grads, compute)
    worker.layout = layout
    assert results[(False, False, 10_000)][2] > results[(True, False, 10_000)][2]  # padding computes more tokens
    assert results[(True, True, 10_000)][2] < results[(True, False, 10_000)][2]  # each prompt laid out once
    l0, g0, _ = results[(True, False, 40)]
    for cfg in configs[1:]:
        loss, grads, _ = results[cfg]
        assert loss == pytest.approx(l0, rel=1e-5, abs=1e-9), cfg
        for k in g0:
            assert torch.allclose(grads[k], g0[k], rtol=1e-4, atol=1e-8), (cfg, k)
    worker.optimizer.zero_grad(set_to_none=True)


@pytest.mark.timeout(120)
def test_reference_kl_entropy_and_non_decoupled_path(tiny_model_dir):
    """kl_coef > 0 loads a frozen reference copy; decoupled=false skips the proximal forward (only the
    mismatch metrics, from the first minibatch)."""
    from asyncrl.learner.worker import LearnerWorker

    w = LearnerWorker(make_cfg(tiny_model_dir, minibatches=2, decoupled=False, kl_coef=0.5, kl_estimator="k3",
                               entropy_coef=0.01, loss_agg="seq_sum_norm", is_level="sequence"))
    ref_before = {k: v.detach().clone() for k, v in w.ref_model.named_parameters()}
    m = w.train_step(make_batch(seed=41))
    # no proximal forward: of the is_* diagnostics only the mismatch against the pre-update policy
    assert {k for k in m if k.startswith("learner/is_")} == {"learner/is_kl_k1", "learner/is_kl_k3"}
    assert m["learner/is_kl_k3"] >= 0
    # minibatch 1 starts at the reference weights (k3 = 0), minibatch 2 after one update (k3 > 0)
    assert 0 < m["learner/kl"] < 1e-3
    assert m["learner/entropy"] > 0 and np.isfinite(m["learner/loss"])
    for k, v in w.ref_model.named_parameters():
        assert torch.equal(v, ref_before[k]) and not v.requires_grad, k


@pytest.mark.timeout(60)
def test_iter_full_params_buckets(worker):
    names = [n for n, _ in worker.model.named_parameters()]
    params = dict(worker.model.named_parameters())
    limit = 300_000
    seen = []
    for bucket in worker.iter_full_params(limit):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
        for name, t in bucket:
            assert torch.equal(t, params[name])
            seen.append(name)
    assert seen == names and not any(n.startswith("_fsdp") or "module." in n for n in seen)
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(worker.iter_full_params(0))


@pytest.mark.timeout(240)
def test_fsdp2_two_ranks_match_one_rank(tiny_model_dir, tmp_path):
    """Same batch, one rank vs two gloo ranks (FSDP2): same loss, updated weights equal within 1e-5
    (fp32; the ranks sum gradients in a different order, and the two optimizer steps move weights by ~2e-3).
    The two-rank checkpoint loads into one process (DCP resharding) and its HF export loads too."""
    from asyncrl.learner.distributed import spawn
    from asyncrl.learner.export import export_checkpoint
    from tests.learner.rank_fns import train_and_dump

    train_and_dump(0, 1, str(tiny_model_dir), str(tmp_path))
    spawn(train_and_dump, 2, str(tiny_model_dir), str(tmp_path))
    one, two = torch.load(tmp_path / "result_w1.pt"), torch.load(tmp_path / "result_w2.pt")
    assert one["metrics"]["learner/loss"] == pytest.approx(two["metrics"]["learner/loss"], rel=1e-4, abs=1e-9)
    assert one["metrics"]["learner/grad_norm"] == pytest.approx(two["metrics"]["learner/grad_norm"], rel=1e-4)
    assert one["metrics"]["learner/tokens"] == two["metrics"]["learner/tokens"]
    assert two["metrics"]["learner/compute_tokens_rank"] < one["metrics"]["learner/compute_tokens_rank"]
    assert one["params"].keys() == two["params"].keys()
    for k, v in one["params"].items():
        assert torch.allclose(two["params"][k], v, rtol=0, atol=1e-5), (k, (two["params"][k] - v).abs().max())
    from transformers import AutoModelForCausalLM

    exported = export_checkpoint(tmp_path / "ckpt_w2", tmp_path / "from_ckpt_w2")
    for d in (exported, tmp_path / "hf_w2"):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        for k, v in m.named_parameters():
            assert torch.equal(v, two["params"][k]), (d, k)


@pytest.mark.timeout(300)
@pytest.mark.heavy(15)
def test_killed_run_resumes_bit_identical(tiny_model_dir, tmp_path):
    """A subprocess SIGKILLed after a checkpoint (mid-way through the next step), resumed in another
    subprocess, ends with weights bit-identical to an uninterrupted run (run here, same thread count)."""
    from tests.learner import resume_run

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = lambda mode: [sys.executable, "-m", "tests.learner.resume_run", mode, str(tiny_model_dir), str(tmp_path)]
    crash = subprocess.Popen(cmd("crash"), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = crash.stdout.readline()
        assert line.strip() == "CHECKPOINTED", crash.stderr.read() if crash.poll() is not None else line
    finally:
        crash.send_signal(signal.SIGKILL)
        crash.wait(timeout=30)
    assert crash.returncode == -signal.SIGKILL
    assert (tmp_path / "ckpt" / "COMPLETE").is_file()
    resumed = subprocess.Popen(cmd("resume"), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    threads = torch.get_num_threads()
    try:
        resume_run.main("full", str(tiny_model_dir), str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    full, res = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert full.keys() == res.keys() and int(full["_version"]) == resume_run.NUM_BATCHES == int(res["_version"])
    for k in full:
        assert torch.equal(full[k], res[k]), k


@pytest.mark.timeout(120)
def test_checkpoint_is_atomic_and_resave_replaces(worker, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from asyncrl.learner import checkpoint as ckpt

    path = tmp_path / "step_000001"
    worker.save_checkpoint(str(path), {"step": 1})
    saved = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    version = worker.version
    worker.train_step(make_batch(seed=21))
    real_save = dcp.save

    def crash_midway(state, checkpoint_id, **kw):  # write part of the files, then die
        real_save({"model": state["model"]}, checkpoint_id=checkpoint_id, **kw)
        raise KeyboardInterrupt("simulated crash during save")

    monkeypatch.setattr(dcp, "save", crash_midway)  # checkpoint.save imports DCP when it runs
    with pytest.raises(KeyboardInterrupt):
        worker.save_checkpoint(str(path), {"step": 2})
    monkeypatch.setattr(dcp, "save", real_save)
    assert (tmp_path / "step_000001.tmp").is_dir()  # the debris is there, but it is not the checkpoint
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.load(tmp_path / "step_000001.tmp", worker.model, worker.optimizer)
    assert worker.load_checkpoint(str(path)) == {"step": 1}
    assert worker.version == version
    for k, v in worker.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    worker.save_checkpoint(str(path), {"step": 3})  # a later save over the same path replaces it whole
    assert not (tmp_path / "step_000001.tmp").exists()
    assert worker.load_checkpoint(str(path)) == {"step": 3}
    with pytest.raises(CheckpointError, match="no checkpoint"):
        worker.load_checkpoint(str(tmp_path / "missing"))


@pytest.mark.timeout(180)
def test_export_cli_loads_with_from_pretrained_and_gives_the_same_logits(worker, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    worker.train_step(make_batch(seed=31))
    worker.save_checkpoint(str(tmp_path / "ckpt"), {})
    ids = torch.tensor([[1, 500, 23, 999, 7, 42]])
    with torch.no_grad():
        want = worker.model(input_ids=ids).logits
    from asyncrl.cli import main as cli_main

    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    worker.export_hf(str(tmp_path / "hf_direct"))
    for d in ("hf", "hf_direct"):
        m = AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(m(input_ids=ids).logits, want), d
        assert AutoTokenizer.from_pretrained(tmp_path / d).chat_template

def test_export_cli_names_a_missing_checkpoint(tmp_path, capsys):
    from asyncrl.cli import main as cli_main

    assert cli_main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 1
    assert f"no checkpoint at {tmp_path / 'nope'}" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_train_step_checkpoint_and_export_on_gpu(tiny_model_dir, tmp_path):
    """One CUDA rank: fp32 master weights, bf16 autocast compute; checkpoint round trip and HF export."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.worker import LearnerWorker

    w = LearnerWorker(make_cfg(tiny_model_dir))
    p0 = next(w.model.parameters())
    assert p0.is_cuda and p0.dtype == torch.float32
    m = w.train_step(_on_policy_batch(w, seed=1))  # behavior logprobs from the same bf16 forward
    assert np.isfinite(m["learner/loss"]) and m["learner/grad_norm"] > 0 and w.version == 1
    assert m["learner/is_mean"] == pytest.approx(1.0, abs=1e-3) and m["learner/is_kl_k3"] < 1e-4
    w.save_checkpoint(str(tmp_path / "ckpt"), {"k": 1})
    saved = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
    w.train_step(make_batch(seed=2))
    assert w.load_checkpoint(str(tmp_path / "ckpt")) == {"k": 1} and w.version == 1
    for k, v in w.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    w.export_hf(str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for k, v in hf.named_parameters():
        assert torch.equal(v, saved[k].cpu()), k
    for bucket in w.iter_full_params(1 << 20):
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= 1 << 20
        assert all(t.is_cuda and t.dtype == torch.float32 for _, t in bucket)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("share", [True, False], ids=["shared_prompt", "prompt_per_sample"])
def test_a_grpo_step_raises_the_rewarded_samples_and_lowers_the_others(tiny_model_dir, share):
    """The direction of learning, on groups whose samples share their prompt (GRPO's shape) with
    on-policy behaviour logprobs: after one step at a small learning rate, every rewarded response is
    more likely and every unrewarded one less likely than before (a sign error, a misplaced target
    or advantage, or a tree layout that mixes branches would break one of the two)."""
    from asyncrl.learner.worker import LearnerWorker

    w = LearnerWorker(make_cfg(tiny_model_dir, lr=1e-4, share_prompts=share, minibatches=1, epochs=1))
    raw = make_batch(seed=3, groups=2, per_group=4, response=(6, 12), shared_prompt=True)
    specs = _specs(raw)
    lp = w._score(w.model, specs, list(range(len(specs))))
    groups, i = [], 0
    for g in raw.groups:
        trajs = []
        for k, t in enumerate(g.trajectories):
            trajs.append(make_trajectory(
                uid=t.uid, group_id=t.group_id, prompt_ids=t.prompt_ids.numpy().tolist(),
                response_ids=t.response_ids.numpy().tolist(), loss_mask=t.loss_mask.numpy().tolist(),
                behavior_logprobs=lp[i].tolist(), versions=t.versions.numpy().tolist(), reward=float(k % 2)))
            i += 1
        groups.append(Group(group_id=g.group_id, trajectories=trajs, expected=len(trajs)))
    batch = Batch(batch_id=1, groups=groups)
    masks = [torch.from_numpy(t.loss_mask.numpy().astype(bool)) for t in batch.trajectories()]
    w.train_step(batch)
    after = w._score(w.model, specs, list(range(len(specs))))
    moved = [float((after[j] - lp[j])[masks[j]].sum()) for j in range(len(specs))]
    rewards = [t.reward for t in batch.trajectories()]
    assert all(d > 0 for d, r in zip(moved, rewards) if r == 1), moved
    assert all(d < 0 for d, r in zip(moved, rewards) if r == 0), moved
