"""LoRA (asyncrl/learner/lora.py): the math by hand, adapters-only training, and merged weights everywhere they
leave the learner: the engine after a real gloo weight sync answers exactly as a fresh engine on the export."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncrl.config import LoraConfig
from asyncrl.engine.launcher import launch_embedded
from asyncrl.learner.lora import LoraLinear, apply_lora, merge_state_dict
from asyncrl.weight_sync import WeightSender
from asyncrl.weight_sync.broadcast import GroupTransport
from tests.learner.helpers import make_batch, make_cfg
from tests.weight_sync.test_sync import greedy

pytestmark = pytest.mark.timeout(240)


def test_lora_linear_is_the_low_rank_update_by_hand():
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(6, 5)
    w, b = base.weight.detach().clone(), base.bias.detach().clone()
    layer = LoraLinear(base, rank=2, alpha=4.0, generator=g)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(5, 2))
    x = torch.randn(3, 6)
    want = x @ w.T + b + (4.0 / 2) * (x @ layer.lora_A.detach().T) @ layer.lora_B.detach().T
    assert torch.allclose(layer(x), want, atol=1e-6)
    merged = merge_state_dict({"l.weight": w, "l.bias": b, "l.lora_A": layer.lora_A.detach(),
                               "l.lora_B": layer.lora_B.detach()}, 2.0)
    assert set(merged) == {"l.weight", "l.bias"}
    assert torch.allclose(x @ merged["l.weight"].T + b, want, atol=1e-5)
    assert not layer.weight.requires_grad and layer.lora_A.requires_grad and layer.lora_B.requires_grad


def test_apply_lora_starts_equal_to_the_base_and_names_unknown_targets(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 77, 300, 9]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    names = apply_lora(model, 4, 8.0, ["q_proj", "v_proj"])
    assert names and all(n.endswith(("q_proj", "v_proj")) for n in names)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # B = 0: the base model exactly
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    with pytest.raises(ValueError, match="match no linear layer.*q_proj"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8.0, ["attention_dense"])


@pytest.fixture(scope="module")
def lora_worker(tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker

    cfg = make_cfg(tiny_model_dir, lr=5e-2)
    cfg = replace(cfg, model=replace(cfg.model, lora=LoraConfig(rank=4, alpha=8.0)))
    w = LearnerWorker(cfg)
    base = {k: v.detach().clone() for k, v in w.model.state_dict().items() if "lora_" not in k}
    for seed in (1, 2):
        w.train_step(make_batch(seed=seed))
    return w, base


def test_only_the_adapters_train_and_what_leaves_is_merged(lora_worker):
    w, base = lora_worker
    sd = w.model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in base.items())  # the frozen base did not move
    assert any(sd[k].abs().sum() > 0 for k in sd if k.endswith("lora_B"))  # the adapters did
    full = w.full_state_dict()
    assert set(full) == set(base) and not any("lora_" in k for k in full)
    changed = [k for k in full if not torch.equal(full[k], base[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                       "gate_proj.weight", "up_proj.weight", "down_proj.weight")) for k in changed)
    synced = dict(p for bucket in w.iter_full_params(1 << 16) for p in bucket)
    assert not any("lora_" in k for k in synced)
    assert all(torch.allclose(synced[k], full[k]) for k in synced)


@pytest.mark.heavy(15)
async def test_engine_after_a_sync_samples_the_adapted_policy_as_the_merged_export(lora_worker, tiny_model_dir,
                                                                                     tmp_path):
    """The silent failure users report elsewhere: engines that keep sampling the initial policy."""
    w, _ = lora_worker
    w.export_hf(str(tmp_path / "merged"))
    with launch_embedded(tiny_model_dir, threads=1) as engine, launch_embedded(tmp_path / "merged", threads=1) as ref:
        before, want = greedy(engine.url), greedy(ref.url)
        assert before != want  # the adapters changed the greedy outputs: the check below can fail
        sender = WeightSender(GroupTransport("gloo", timeout_s=60), timeout_s=60)
        await sender.connect([engine.url])
        try:
            report = await sender.sync(w.iter_full_params(1 << 16), version=3)
        finally:
            await sender.close()
        assert report.ok
        assert greedy(engine.url) == want


def test_checkpoint_export_merges_the_adapters(lora_worker, tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.cli import main as cli_main

    w, _ = lora_worker
    w.save_checkpoint(str(tmp_path / "ckpt"), {})
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    full = w.full_state_dict()
    got = m.state_dict()
    assert all(torch.allclose(got[k], full[k]) for k in full)


@pytest.mark.heavy(14)
def test_fsdp2_two_ranks_train_the_same_adapters_as_one(tiny_model_dir, tmp_path):
    from asyncrl.learner.distributed import spawn
    from tests.learner.rank_fns import lora_train_and_dump

    lora_train_and_dump(0, 1, str(tiny_model_dir), str(tmp_path))
    spawn(lora_train_and_dump, 2, str(tiny_model_dir), str(tmp_path))
    one, two = torch.load(tmp_path / "lora_w1.pt"), torch.load(tmp_path / "lora_w2.pt")
    assert one["metrics"]["learner/loss"] == pytest.approx(two["metrics"]["learner/loss"], rel=1e-4, abs=1e-9)
    assert one["params"].keys() == two["params"].keys() and not any("lora_" in k for k in one["params"])
    for k, v in one["params"].items():
        assert torch.allclose(two["params"][k], v, rtol=0, atol=1e-5), k
    from safetensors.torch import load_file

    base = load_file(tiny_model_dir / "model.safetensors")
    moved = [k for k in base if k.endswith("q_proj.weight") and not torch.equal(base[k], one["params"][k])]
    assert moved  # the merged weights carry the trained adapters
