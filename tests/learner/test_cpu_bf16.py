"""model.cpu_bf16: bf16 autocast for the learner on a CPU with native bf16, fp32 masters; fp32 elsewhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncrl.learner import worker as worker_mod
from asyncrl.learner.packing import specs_of
from asyncrl.util import cpus
from tests.learner.helpers import make_batch, make_cfg


def _cfg(tiny_model_dir, on: bool):
    cfg = make_cfg(tiny_model_dir)
    return replace(cfg, model=replace(cfg.model, cpu_bf16=on))


@pytest.mark.skipif(not cpus.native_bf16(), reason="this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
def test_bf16_logits_are_close_to_fp32_and_masters_stay_fp32(tiny_model_dir):
    from asyncrl.learner.packing import build_micro_batch, kept_logits

    fp32 = worker_mod.LearnerWorker(_cfg(tiny_model_dir, False))
    bf16 = worker_mod.LearnerWorker(_cfg(tiny_model_dir, True))
    assert bf16.cpu_bf16 and not fp32.cpu_bf16
    specs = _specs(make_batch(seed=5))
    mb = build_micro_batch(specs, list(range(len(specs))), True, fp32.pad_id)
    def logits(w):  # the whole logits, as the head computes them under the worker's autocast
        with w._autocast():
            return kept_logits(w.model, mb)

    a, b = logits(fp32), logits(bf16)
    assert b.dtype == torch.bfloat16 and a.dtype == torch.float32
    assert torch.allclose(a, b.float(), atol=0.1, rtol=0.05) and not torch.equal(a, b.float())
    m = bf16.train_step(make_batch(seed=6))
    assert torch.isfinite(torch.tensor(m["learner/loss"]))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in bf16.optimizer.state.values())


def test_without_native_bf16_the_learner_stays_fp32_and_says_so(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(worker_mod, "native_bf16", lambda: False)
    w = worker_mod.LearnerWorker(_cfg(tiny_model_dir, True))
    assert not w.cpu_bf16
    assert "has no native bf16" in caplog.text


def _specs(batch):
    return specs_of(batch.trajectories())[0]
