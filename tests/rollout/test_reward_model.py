"""Reward models on the rollout side (asyncrl/rollout/reward_model.py), on real models:

- a discriminative reward model: a tiny sequence-classification Llama built here, behind the batching
  SequenceScorer; in the buffer path, a real RolloutWorker (ScriptedEngine test double for the policy's
  engine) puts trajectories whose reward combines the env's and the model's into a real buffer;
- a generative judge: the real embedded engine serving a tiny Llama whose output head is rewired so
  that every token it can emit is a digit (so its verdicts parse), through the real EngineClient.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.server import BufferService
from asyncrl.config import BufferConfig, ConfigError, RewardModelConfig, load_config
from asyncrl.data.schema import make_trajectory
from asyncrl.rollout.reward_model import (
    GenerativeJudge,
    RewardModel,
    RewardModelError,
    SequenceScorer,
    conversation_text,
    fill_template,
    parse_verdict,
)
from asyncrl.rollout.worker import RolloutWorker
from tests.agents.scripted_engine import ScriptedEngine

from .worker_harness import controller_round, stop

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A seeded tiny LlamaForSequenceClassification (one label) with the SmolLM2 tokenizer."""
    out = tmp_path_factory.mktemp("tiny_rm")
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.num_labels = 1
    torch.manual_seed(1)
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def _traj(uid: str, text: str, reward: float = 1.0):
    return make_trajectory(uid=uid, group_id="g", prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1],
                           behavior_logprobs=[-0.5, -0.5], versions=[0, 0], reward=reward,
                           messages=[{"role": "user", "content": "What is 2 + 2?"},
                                     {"role": "assistant", "content": text}])


async def test_the_scorer_batches_concurrent_requests_and_scores_as_one_forward_each(rm_dir):
    scorer = SequenceScorer(RewardModelConfig(kind="discriminative", path=str(rm_dir), batch_size=4, max_wait_ms=200,
                                              max_length=64))
    texts = ["four", "The answer is 4.", "5", "a" * 5000, "Answer: 4"]  # one far past max_length
    got = await asyncio.gather(*(scorer.score([t]) for t in texts))
    assert scorer.batches == [4, 1]  # all five queued at once: one full batch, then the rest after max_wait_ms
    alone = [scorer.score_now([t])[0] for t in texts]
    assert [g[0] for g in got] == pytest.approx(alone, abs=1e-5)
    assert len(set(round(x, 6) for x in alone)) > 1  # the scores depend on the text
    # a long text keeps its end: it scores as its last max_length tokens do
    ids = scorer.tokenizer("a" * 5000)["input_ids"][-64:]
    assert alone[3] == pytest.approx(scorer.score_now([scorer.tokenizer.decode(ids)])[0], abs=1e-4)


def test_a_reward_model_with_several_labels_or_no_path_is_refused(tiny_model_dir, tmp_path):
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.num_labels = 3
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has one label .* this one has 3"):
        SequenceScorer(RewardModelConfig(kind="discriminative", path=str(tmp_path)))
    with pytest.raises(ConfigError, match="reward_model.path"):
        RewardModelConfig(kind="discriminative")
    with pytest.raises(ConfigError, match="reward_model.pattern"):
        RewardModelConfig(kind="generative", pattern="no group")
    with pytest.raises(ConfigError, match="reward_model.pattern: not a regular expression"):
        RewardModelConfig(kind="generative", pattern="(")
    with pytest.raises(ConfigError, match="reward_model.weight"):
        RewardModelConfig(weight=float("nan"))


def test_judge_prompts_are_filled_literally_and_verdicts_parsed_strictly():
    # model text holding format fields or braces is not evaluated
    assert fill_template("Q: {prompt} A: {response} GT: {ground_truth}", "{response}", "{0.__class__}", None) == \
        "Q: {response} A: {0.__class__} GT: "
    assert parse_verdict("Score: 7 out of 9", r"(\d+)", 9.0) == pytest.approx(7 / 9)
    assert parse_verdict("no digits", r"(\d+)", 9.0) is None
    assert parse_verdict("1e999", r"(\S+)", 1.0) is None  # inf is not a score
    assert parse_verdict("nan", r"(\S+)", 1.0) is None


async def test_a_real_worker_puts_trajectories_scored_by_the_reward_model_into_the_buffer(tokenizer, tmp_path, rm_dir):
    cfg = load_config(["agent=single_turn", "trainer=sync", "trainer.batch_groups=1", "algorithm.n_samples=2",
                       f"trainer.output_dir={tmp_path}", "reward_model.kind=discriminative",
                       f"reward_model.path={rm_dir}", "reward_model.weight=0.5", "reward_model.rule_weight=2"])
    scorer = SequenceScorer(cfg.reward_model)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "reward_model": {"ground_truth": "4"},
             "data_source": "test"}]
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", 0)
    svc.start()
    consumer = BufferConsumer(svc.address)
    engine = ScriptedEngine(tokenizer, ["Answer: 4", "Answer: 5"] * 8)
    worker = RolloutWorker(cfg, worker_id=0, num_workers=1, rows=rows, engine=engine, tokenizer=tokenizer,
                           buffer_address=svc.address, output_dir=tmp_path, run_id="rm", reward_scorer=scorer)
    run = asyncio.create_task(worker.run())
    try:
        batch = None
        for _ in range(300):
            await controller_round(svc, consumer, worker, [])
            batch = await asyncio.to_thread(consumer.get_batch, 1, 0, timeout_s=0.2)
            if batch is not None:
                break
        assert batch is not None, worker.state()
    finally:
        await stop(worker, run, consumer, svc)
    trajs = batch.trajectories()
    assert len(trajs) == 2
    for t in trajs:
        want_model = scorer.score_now([conversation_text(t.messages, scorer.tokenizer)])[0]
        assert t.metrics["reward/model"] == pytest.approx(want_model, abs=1e-5)
        assert t.reward == pytest.approx(2 * t.metrics["reward/rule"] + 0.5 * want_model, abs=1e-5)
        assert t.metrics["reward_model/failed"] == 0 and t.metrics["reward_model/seconds"] >= 0
    assert {t.metrics["reward/rule"] for t in trajs} <= {0.0, 1.0}
    assert worker.state().reward_model_failures == 0  # what the controller reads


# ----------------------------------------------------------------------------- the generative judge


@pytest.fixture(scope="module")
def digit_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama, untied, with its final norm keeping one hidden dimension and its output head
    pointing that dimension at '7' (positive) and '3' (negative): greedy decoding emits only those digits."""
    out = tmp_path_factory.mktemp("digit_model")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.tie_word_embeddings = False
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.convert_tokens_to_ids("7"), 0] = 100.0
        model.lm_head.weight[tok.convert_tokens_to_ids("3"), 0] = -100.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


async def test_a_generative_judge_over_the_embedded_engine_returns_parsed_scores(digit_model_dir):
    from asyncrl.engine import launcher
    from asyncrl.engine.client import EngineClient

    tok = AutoTokenizer.from_pretrained(digit_model_dir)
    cfg = RewardModelConfig(kind="generative", pattern=r"(\d)", scale=9.0, max_new_tokens=1, weight=1.0,
                            rule_weight=0.0)
    trajs = [_traj(f"u{i}", text) for i, text in enumerate(["4", "The answer is 4.", "five", "{response} 9"])]
    with launcher.launch_embedded(digit_model_dir, threads=1, max_running_seqs=4, startup_timeout_s=120) as proc:
        client = EngineClient(proc.url, timeout_s=60)
        try:
            judge = GenerativeJudge(cfg, client, tok)
            score, reply = await judge.verdict("What is 2 + 2?", "4", "4", rid="judge-0")
            assert reply in ("7", "3") and score == pytest.approx(int(reply) / 9)
            scored = await RewardModel(cfg, judge=judge).apply("What is 2 + 2?", "4", trajs)

            # a pattern that never matches: a failure, scored 0 (on_failure=zero) or failing the episode
            bad = RewardModelConfig(kind="generative", pattern=r"(x)", max_new_tokens=1, on_failure="zero")
            rm = RewardModel(bad, judge=GenerativeJudge(bad, client, tok))
            zeroed = await rm.apply("q", None, trajs[:2])
            strict = RewardModelConfig(kind="generative", pattern=r"(x)", max_new_tokens=1, on_failure="fail_episode")
            with pytest.raises(RewardModelError, match="no verdict for u0: unparsable verdict"):
                await RewardModel(strict, judge=GenerativeJudge(strict, client, tok)).apply("q", None, trajs[:1])
        finally:
            await client.close()
    for t in scored:
        assert t.metrics["reward_model/failed"] == 0
        assert t.reward == t.metrics["reward/model"] and t.reward in (pytest.approx(7 / 9), pytest.approx(3 / 9))
        assert t.metrics["reward/rule"] == 1.0
    assert rm.failures == 2 and all(t.metrics["reward_model/failed"] == 1 for t in zeroed)
    assert [t.reward for t in zeroed] == [1.0, 1.0]  # rule_weight 1 * rule 1 + weight 1 * 0
