"""A real RolloutWorker and a real buffer service: a worker that replaces one that died after its puts and
before its trajectory dump issues the same group again (same uids, the position it starts from); the buffer
answers 'dup' and keeps the first attempt, which is the one that trains. The dump must not then hold the
second attempt as that uid's record (`asyncrl view` would pair the first attempt's training step with
the second attempt's versions: a staleness of -1, seen in the e2e fault test).

The engine is the ScriptedEngine test double (no model)."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.server import BufferService
from asyncrl.config import BufferConfig, load_config
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.run_dir import RunLayout
from tests.agents.scripted_engine import ScriptedEngine

from .worker_harness import stop

pytestmark = pytest.mark.timeout(120)

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "reward_model": {"ground_truth": str(2 * i)},
         "data_source": "test"} for i in range(4)]
RUN = "run8"


async def _until(cond, what: str, run: asyncio.Task) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not cond():
        assert not run.done(), run
        assert loop.time() < deadline, f"not within 60 s: {what}"
        await asyncio.sleep(0.05)


async def test_an_attempt_the_buffer_already_holds_is_not_dumped_as_that_uids_record(tokenizer, tmp_path,
                                                                                     plugin_registry):
    cfg = load_config(["agent=single_turn", "trainer=sync", "trainer.batch_groups=1", "algorithm.n_samples=2",
                       f"trainer.output_dir={tmp_path}"])
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", cfg.algorithm.max_staleness)
    svc.start()
    consumer = BufferConsumer(svc.address)
    dump = RunLayout(tmp_path).trajectories(0)

    def worker(engine: ScriptedEngine) -> RolloutWorker:
        return RolloutWorker(cfg, worker_id=0, num_workers=1, rows=ROWS, engine=engine, tokenizer=tokenizer,
                             buffer_address=svc.address, output_dir=tmp_path, run_id=RUN)

    first = worker(ScriptedEngine(tokenizer, ["The answer is 0."] * 8, version=0))
    second = None
    run = asyncio.create_task(first.run())
    try:
        await _until(lambda: dump.is_file() and len(dump.read_text().splitlines()) == 2, "g0 stored and dumped", run)
        first.stop()
        await asyncio.wait_for(run, 30)
        stored = [json.loads(line) for line in dump.read_text().splitlines()]
        assert sorted(r["uid"] for r in stored) == [f"{RUN}-g0-0", f"{RUN}-g0-1"]
        assert {r["min_version"] for r in stored} == {0}
        dump.unlink()  # as if the first worker died after its puts, before it wrote its dump
        # its replacement starts from the position before g0 was reported: g0 again, now at version 3
        second = worker(ScriptedEngine(tokenizer, ["The answer is 0."] * 8, version=3))
        run = asyncio.create_task(second.run())
        await _until(lambda: second.counts["episodes"] >= 2, "g0's second attempt put", run)
    finally:
        await stop(second or first, run, consumer, svc)
    assert svc.stats()["duplicates"] == 2, svc.stats()
    again = [json.loads(line) for line in dump.read_text().splitlines()] if dump.is_file() else []
    assert not [r for r in again if r["uid"].startswith(f"{RUN}-g0-")], again
