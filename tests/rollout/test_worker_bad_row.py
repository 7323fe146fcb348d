"""A real RolloutWorker drawing from a streamed file and a real buffer service: a row that breaks the verl
schema, found only when drawn, fails that group's episodes with an error naming the file and the row (no
engine call is made for it), and the worker goes on with the next prompt; the run does not stop."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.server import BufferService
from asyncrl.config import BufferConfig, load_config
from asyncrl.data.dataset import open_dataset
from asyncrl.rollout.worker import RolloutWorker
from tests.agents.scripted_engine import ScriptedEngine

from .worker_harness import controller_round, stop

pytestmark = pytest.mark.timeout(120)


async def test_a_bad_row_fails_its_group_naming_file_and_row_and_the_worker_goes_on(tokenizer, tmp_path):
    good = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "reward_model": {"ground_truth": "4"}}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({**good, "prompt": [{"role": "user"}]}) + "\n" + json.dumps(good) + "\n")
    cfg = load_config(["agent=single_turn", "trainer.batch_groups=1", "algorithm.n_samples=2",
                       f"trainer.output_dir={tmp_path}", "trainer.max_prompt_retries=0"])
    svc = BufferService(BufferConfig(curve="off"), tmp_path / "wal", cfg.algorithm.max_staleness)
    svc.start()
    consumer = BufferConsumer(svc.address)
    engine = ScriptedEngine(tokenizer, ["The answer is 4."] * 64)
    worker = RolloutWorker(cfg, worker_id=0, num_workers=1, rows=open_dataset(path), engine=engine,
                           tokenizer=tokenizer, buffer_address=svc.address, output_dir=tmp_path, run_id="t")
    bad_position = next(p for p in range(2) if worker.source.at(p).data_index == 0)
    run = asyncio.create_task(worker.run())
    dropped: list[tuple[str, str]] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while not (dropped and worker.counts["episodes"] >= 2):
            assert not run.done(), run
            assert loop.time() < deadline, f"dropped {dropped}, counts {worker.counts}"
            await controller_round(svc, consumer, worker, dropped)
            await asyncio.sleep(0.1)
        st = worker.state()
    finally:
        await stop(worker, run, consumer, svc)

    assert dropped[0] == (f"t-g{bad_position}", "failed")
    (err,) = [e for e in st.errors if "rows.jsonl" in e.message]
    assert f"{path.resolve()}, row 0, field 'prompt[0].content': missing" in err.message and err.data_index == 0
    assert st.episodes_failed >= 2 and st.episodes >= 2  # the good row's episodes ran beside it
    good_text = "What is 2 + 2?"
    assert all(good_text in tokenizer.decode(ids) for ids, _ in engine.calls)  # only the good row reached the engine
