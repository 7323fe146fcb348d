"""A reward function that returns NaN or inf: the episode fails naming the function and the uid; the
rollout worker counts it, reports the member failed to the (real) buffer, does not retry, and goes on.
The buffer itself refuses a trajectory with a non-finite reward or logprob at PUT."""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec
import pytest

from asyncrl.agents.base import run_episode
from asyncrl.buffer.client import AsyncBufferProducer, BufferError
from asyncrl.buffer.server import BufferService
from asyncrl.config import AgentConfig, BufferConfig, Config, EnvConfig, ModelConfig, RewardConfig
from asyncrl.data.schema import Array, NonFiniteRewardError
from asyncrl.envs.base import Sample

from .helpers import make_ctx, make_sample
from .scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(120)

REWARD_FILE = '''
def shaky_reward(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
    """NaN for the prompts whose ground truth says so, 1.0 otherwise."""
    return float(ground_truth) if ground_truth in ("nan", "inf", "-inf") else 1.0
'''


def nan_reward(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
    return float("nan")


def inf_score(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
    return {"score": math.inf, "correct": 0.0}


@pytest.mark.parametrize("fn,shown", [(nan_reward, "nan"), (inf_score, "inf")])
async def test_non_finite_reward_fails_the_episode_naming_function_and_uid(tokenizer, fn, shown):
    engine = ScriptedEngine(tokenizer, ["Answer: 17"])
    ctx, _ = make_ctx(tokenizer, engine, tools=[])
    ctx.reward_fn = fn
    with pytest.raises(NonFiniteRewardError, match=rf"reward function {fn.__name__} \(for g0-0\) returned {shown}: a "
                                                   r"reward must be a finite number"):
        await run_episode(make_sample(), ctx, "single_turn")


def huge_reward(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
    return 1.7e308  # finite: its square is not, nor a group's std


@pytest.mark.parametrize("bound,value,ok", [(1e6, 1.7e308, False), (1e6, -1e6, True), (1e6, -1.000001e6, False),
                                            (10.0, 10.5, False), (10.0, 10.0, True)])
async def test_a_reward_beyond_env_reward_max_abs_fails_its_episode_naming_function_uid_and_bound(
        tokenizer, bound, value, ok):
    engine = ScriptedEngine(tokenizer, ["Answer: 17"])
    ctx, _ = make_ctx(tokenizer, engine, tools=[])
    ctx.reward_fn = huge_reward if value == 1.7e308 else (lambda **kw: value)
    ctx.reward_max_abs = bound
    if ok:
        assert (await run_episode(make_sample(), ctx, "single_turn")).reward == value
        return
    with pytest.raises(NonFiniteRewardError, match=re.escape(f"(for g0-0) returned {value!r}, beyond "
                                                             f"env.reward.max_abs={bound:g}: ")):
        await run_episode(make_sample(), ctx, "single_turn")


def test_the_bound_is_the_configs_and_a_bad_one_is_refused_at_load():
    from asyncrl.agents.base import AgentContext
    from asyncrl.config import ConfigError, load_config

    cfg = load_config(["env.reward.max_abs=50"])
    assert AgentContext.for_config(cfg, engine=None, tokenizer=None).reward_max_abs == 50.0
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"env.reward.max_abs: must be a finite number > 0, got {bad}"):
            load_config([f"env.reward.max_abs={bad}"])


def _sample(uid: str, ground_truth: str) -> Sample:
    return Sample(uid=uid, group_id=f"grp-{uid}", group_size=1, sample_index=0, data_index=0,
                  messages=[{"role": "user", "content": "What is 3*4+5?"}], ground_truth=ground_truth)


async def test_rollout_worker_counts_a_nan_reward_reports_it_failed_and_goes_on(tokenizer, tiny_model_dir,
                                                                                 tmp_path: Path):
    from asyncrl.rollout.worker import RolloutWorker

    reward_file = tmp_path / "shaky.py"
    reward_file.write_text(REWARD_FILE)
    cfg = Config(model=ModelConfig(path=str(tiny_model_dir)), agent=AgentConfig(name="single_turn"),
                 env=EnvConfig(tools=[], reward=RewardConfig(path=str(reward_file), name="shaky_reward")))
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", max_staleness=0)
    svc.start()
    engine = ScriptedEngine(tokenizer, ["Answer: 17", "Answer: 17"])
    worker = RolloutWorker(cfg, worker_id=0, num_workers=1, rows=[{"prompt": []}], engine=engine,
                           tokenizer=tokenizer, buffer_address=svc.address, output_dir=tmp_path, run_id="r1")
    try:
        await worker._run_episode(_sample("bad", "nan"))
        assert len(engine.calls) == 1  # not retried: the reward's verdict would not change
        assert worker.counts["reward_nonfinite"] == 1 and worker.counts["episodes_failed"] == 1
        assert worker.state().reward_nonfinite == 1  # what the controller rolls up (rollout/reward_nonfinite)
        await worker._run_episode(_sample("good", "17"))
        assert worker.counts["episodes"] == 1 and worker.counts["reward_sum"] == 1.0
        st = svc.stats()
        assert st["failed_reported"] == 1 and st["received"] == 1
    finally:
        await worker.producer.close()
        svc.stop()


@pytest.mark.parametrize("field,value,needle", [
    ("reward", math.nan, "reward is nan, not a finite number"),
    ("turn_rewards", [0.0, math.inf], "turn_rewards[1] is inf, not a finite number"),
    ("behavior_logprobs", [-1.0, -math.inf], "behavior_logprobs[1] is -inf, not a finite number"),
])
async def test_buffer_refuses_non_finite_numbers_at_put(tmp_path, field, value, needle):
    from tests.buffer.conftest import traj

    t = traj("u1", "g1", n=2)
    if field == "behavior_logprobs":
        value = Array.of(value, "float32")
    t = msgspec.structs.replace(t, **{field: value})
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", max_staleness=0)
    svc.start()
    producer = AsyncBufferProducer(svc.address, timeout_s=30.0, retries=1)
    try:
        with pytest.raises(BufferError, match="refused a put: PUT trajectory u1: " + needle.replace("[", r"\[")):
            await producer.put(t)
        assert svc.stats()["malformed"] == 1 and svc.stats()["size"] == 0
    finally:
        await producer.close()
        svc.stop()
