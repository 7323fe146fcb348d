"""A real RolloutWorker and a real buffer service: a group the buffer closes unserved gives its start back,
its prompt is issued again as a new group, and after `trainer.max_prompt_retries` it is skipped.

The engine is the ScriptedEngine test double (no model); the reward function is a real plugin file that
raises, so every episode fails, is reported to the buffer, and each group closes with no member. With
one group of budget (sync, one group a step) and no batch ever trained, the worker could start nothing
after its first group unless the buffer's report gave the start back.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.server import BufferService
from asyncrl.config import BufferConfig, load_config
from asyncrl.rollout.worker import RolloutWorker
from tests.agents.scripted_engine import ScriptedEngine

from .worker_harness import rounds_until, stop

pytestmark = pytest.mark.timeout(120)

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "reward_model": {"ground_truth": str(2 * i)},
         "data_source": "test"} for i in range(4)]
RUN = "run7"


def _worker(cfg, tokenizer, engine, address, tmp_path, position=None) -> RolloutWorker:
    w = RolloutWorker(cfg, worker_id=0, num_workers=1, rows=ROWS, engine=engine, tokenizer=tokenizer,
                      buffer_address=address, output_dir=tmp_path, position=position, run_id=RUN)
    w.EPISODE_ATTEMPTS = 1  # fail an episode on its first error (the retry pause is not what is tested)
    return w


async def test_a_dropped_group_returns_its_budget_and_is_reissued_then_skipped(tokenizer, tmp_path, plugin_registry):
    reward = tmp_path / "boom_reward.py"
    reward.write_text("def boom(**kw):\n    raise ValueError('reward exploded')\n")
    cfg = load_config(["agent=single_turn", "trainer=sync", "trainer.batch_groups=1", "algorithm.n_samples=2",
                       "trainer.max_prompt_retries=2", f"env.reward.path={reward}", "env.reward.name=boom",
                       f"trainer.output_dir={tmp_path}"])
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", cfg.algorithm.max_staleness)
    svc.start()
    consumer = BufferConsumer(svc.address)
    engine = ScriptedEngine(tokenizer, ["The answer is 4."] * 64)
    worker = _worker(cfg, tokenizer, engine, svc.address, tmp_path)
    run = asyncio.create_task(worker.run())
    reported: list[tuple[str, str]] = []
    try:
        # the three issues of g0 reported; then g1 starts (no round after it, so its own drop is not handed over)
        await rounds_until(svc, consumer, worker, run, reported, lambda: len(reported) >= 3)
        while worker.counts["groups_started"] < 4:
            assert not run.done(), run
            await asyncio.sleep(0.05)
        st = worker.state()
    finally:
        await stop(worker, run, consumer, svc)

    assert reported == [(f"{RUN}-g0", "failed"), (f"{RUN}-g0r1", "failed"), (f"{RUN}-g0r2", "failed")]
    pos = st.position
    assert (pos.started_groups, pos.returned_groups, pos.prompts_skipped) == (4, 3, 1)
    assert pos.retries == {0: 3} and pos.waiting_positions == [] and st.groups_dropped == 3
    assert st.prompts_reissued == 2 and st.episodes_failed >= 6
    assert st.errors[0].message == "ValueError('reward exploded')" and st.errors[0].data_index == worker.source.at(0).data_index
    assert st.recent_failed == st.recent_episodes >= 6
    prompts = [ids for ids, _ in engine.calls]
    assert prompts[0] == prompts[5] and prompts[6] != prompts[0]  # g0, g0r1, g0r2 asked the same prompt, then g1

    # a restarted worker keeps the returned budget and retry numbers; a report applied before changes nothing
    again = _worker(cfg, tokenizer, engine, svc.address, tmp_path, position=pos)
    assert (again.gate.started, again.gate.returned) == (4, 3)
    assert again.state().position == pos  # g1, in flight when the first one stopped, is named before run()
    after = await again.groups_dropped([f"{RUN}-g0r2", f"{RUN}-g0r1", f"{RUN}-g0", f"{RUN}-g1r1", f"{RUN}-g9",
                                        "other-g1", "g1", "val-3"])  # handled, not current, not drawn, other run, hostile
    assert after.position == pos
    await again.producer.close()


async def test_a_group_of_equal_rewards_closed_by_dynamic_sampling_draws_a_fresh_prompt(tokenizer, tmp_path,
                                                                                       plugin_registry):
    """algorithm.dynamic_sampling: every group here has equal rewards (one scripted answer, a constant reward),
    so the buffer closes each as "uniform"; its start comes back and the worker draws the NEXT prompt, never
    the same one again, and nothing is skipped. With one group of budget and no batch ever trained, the
    worker could start nothing after its first group without that."""
    reward = tmp_path / "one_reward.py"
    reward.write_text("def one(**kw):\n    return 1.0\n")
    cfg = load_config(["agent=single_turn", "trainer=sync", "trainer.batch_groups=1", "algorithm.n_samples=2",
                       "algorithm.dynamic_sampling=true", f"env.reward.path={reward}", "env.reward.name=one",
                       f"trainer.output_dir={tmp_path}"])
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", cfg.algorithm.max_staleness, uniform_limit=100)
    svc.start()
    consumer = BufferConsumer(svc.address)
    engine = ScriptedEngine(tokenizer, ["The answer is 4."] * 64)
    worker = _worker(cfg, tokenizer, engine, svc.address, tmp_path)
    run = asyncio.create_task(worker.run())
    reported: list[tuple[str, str]] = []
    try:
        await rounds_until(svc, consumer, worker, run, reported,
                           lambda: worker.counts["groups_started"] >= 4 and len(reported) >= 3)
        st = worker.state()
    finally:
        await stop(worker, run, consumer, svc)
    assert reported[:3] == [(f"{RUN}-g{p}", "uniform") for p in range(3)]
    pos = st.position
    assert pos.prompts_skipped == 0 and pos.waiting_positions == [] and st.prompts_reissued == 0
    assert st.groups_filtered == st.groups_dropped == len(reported) and pos.returned_groups == len(reported)
    prompts = [ids for ids, _ in engine.calls]
    assert len({tuple(p) for p in prompts[:8]}) == 4  # g0..g3: two samples each of four different prompts
    again = _worker(cfg, tokenizer, engine, svc.address, tmp_path, position=pos)  # a repeated report: ignored
    assert (await again.groups_dropped([f"{RUN}-g0"], [f"{RUN}-g0"])).position == pos
    await again.producer.close()
