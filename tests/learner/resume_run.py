"""A training run as a subprocess, for the kill-and-resume test.

  python -m tests.learner.resume_run full   MODEL OUT   NUM_BATCHES steps, then dump the weights to OUT/full.pt
  python -m tests.learner.resume_run crash  MODEL OUT   one step, checkpoint, print CHECKPOINTED, start the
                                                        next step and wait to be SIGKILLed
  python -m tests.learner.resume_run resume MODEL OUT   load the checkpoint, the remaining steps, dump OUT/resumed.pt
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from tests.learner.helpers import make_batch, make_cfg

NUM_BATCHES = 2
ALGO = dict(minibatches=2, epochs=1, micro_batch_tokens=32, lr=1e-3, warmup_steps=2, lr_schedule="cosine",
            weight_decay=0.01)


def main(mode: str, model_dir: str, out: str) -> None:
    from asyncrl.learner.worker import LearnerWorker

    torch.set_num_threads(1)
    out_p = Path(out)
    worker = LearnerWorker(make_cfg(model_dir, **ALGO))
    batches = [make_batch(seed=10 + i, batch_id=i, groups=2, per_group=2) for i in range(NUM_BATCHES)]
    start = 0
    if mode == "resume":
        extra = worker.load_checkpoint(str(out_p / "ckpt"))
        start = extra["next_batch"]
    for i in range(start, NUM_BATCHES):
        worker.train_step(batches[i])
        if mode == "crash" and i == 0:
            worker.save_checkpoint(str(out_p / "ckpt"), {"next_batch": 1})
            print("CHECKPOINTED", flush=True)
            worker.train_step(batches[1])  # progress that the checkpoint does not hold
            time.sleep(600)  # the test SIGKILLs us here
    name = {"full": "full.pt", "resume": "resumed.pt"}[mode]
    torch.save({k: v.detach().clone() for k, v in worker.model.state_dict().items()}
               | {"_version": torch.tensor(worker.version)}, out_p / name)


if __name__ == "__main__":
    main(*sys.argv[1:4])
