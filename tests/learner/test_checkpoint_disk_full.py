"""A checkpoint save on a disk that fills part-way (a real tmpfs, tests/tmpfs.py): torch's writer fails
without an errno and DCP wraps it in a BaseException; the save still ends as `CheckpointDiskFull`, leaves no
`<step>.tmp`, and the previous checkpoint stays complete. Once there is room the same save succeeds."""

from __future__ import annotations

import json

from tests.tmpfs import python_on_tmpfs

SAVE_UNTIL_FULL = r"""
import json, sys
from pathlib import Path
import torch
from asyncrl.learner import checkpoint as ckpt

root = Path(sys.argv[1]) / "checkpoints"
model = torch.nn.Linear(512, 512)  # about 1 MiB of weights, 3 MiB with Adam's moments
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 512)).sum().backward()
opt.step()
first = ckpt.save(root / "step_000001", model, opt, meta={"step": 1})
found = {}
try:
    ckpt.save(root / "step_000002", model, opt, meta={"step": 2})
    found["second"] = "saved"
except ckpt.CheckpointDiskFull as e:
    found["second"] = str(e)
found["names"] = sorted(p.name for p in root.iterdir())
ckpt.check_complete(first)  # raises if the first was touched
(root / "step_000001").rename(root.parent / "moved")  # room: the first goes
import shutil; shutil.rmtree(root.parent / "moved")
ckpt.check_complete(ckpt.save(root / "step_000002", model, opt, meta={"step": 2}))
found["after_room"] = sorted(p.name for p in root.iterdir())
print("FOUND " + json.dumps(found))
"""


def test_a_save_that_fills_the_disk_leaves_the_last_checkpoint_and_no_debris(tmp_path):
    res = python_on_tmpfs(tmp_path / "d", "5m", SAVE_UNTIL_FULL)
    line = next((x for x in res.stdout.splitlines() if x.startswith("FOUND ")), None)
    assert line is not None, res.stdout[-2000:] + res.stderr[-4000:]
    found = json.loads(line[len("FOUND "):])
    assert found["second"].startswith(f"no space left on the device of {tmp_path / 'd' / 'checkpoints'} writing "
                                      "checkpoint step_000002 ("), found
    assert found["second"].endswith("MiB free after removing what it had written); nothing of it was kept"), found
    assert found["names"] == ["step_000001"], found
    assert found["after_room"] == ["step_000002"], found
