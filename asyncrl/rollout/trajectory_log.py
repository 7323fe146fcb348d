"""The run's readable trajectory files, `trajectories-w<k>.jsonl`: one JSON line per stored trajectory.

Written by rollout worker k (a `trainer.dump_trajectories` fraction of its trajectories, picked by their uid
and the run's seed: asyncrl/util/seeds.py `selected`, the rule the learner's `learner_logprobs.jsonl` follows
too), appended a whole line at a time; read by `asyncrl view` (asyncrl/view/records.py), which joins them with
`trained_uids.jsonl` (the step and version each uid was trained in) and `dropped_groups.jsonl` (groups the
buffer closed unserved, and why). A line holds the conversation (`messages`), the reward and its parts
(`metrics`), and the response's per-token arrays (`response_ids`, `loss_mask`, `versions`,
`behavior_logprobs`, rounded to 4 decimals) so a viewer can colour tokens by who wrote them, by policy
version and by behaviour logprob.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from asyncrl.data.schema import Trajectory
from asyncrl.run_dir import RunLayout
from asyncrl.util.seeds import selected

log = logging.getLogger(__name__)


def trajectory_record(traj: Trajectory, now: float | None = None) -> dict[str, Any]:
    """The JSON-ready line of one trajectory."""
    return {
        "uid": traj.uid, "group_id": traj.group_id, "group_size": traj.group_size, "env": traj.env,
        "agent": traj.agent, "data_index": traj.data_index, "sample_index": traj.sample_index,
        "reward": traj.reward, "num_turns": traj.num_turns, "finish_reason": traj.finish_reason,
        "min_version": traj.min_version(), "prompt_tokens": len(traj.prompt_ids),
        "response_tokens": len(traj.response_ids), "metrics": traj.metrics, "turn_rewards": traj.turn_rewards,
        "tool_rewards": traj.tool_rewards, "messages": traj.messages,
        "response_ids": traj.response_ids.numpy().tolist(),
        "loss_mask": traj.loss_mask.numpy().tolist(),
        "versions": traj.versions.numpy().tolist(),
        "behavior_logprobs": [round(x, 4) for x in traj.behavior_logprobs.numpy().tolist()],
        "time": time.time() if now is None else now,
    }


class TrajectoryLog:
    """Appends a seeded `fraction` of the trajectories it is given to `output_dir/trajectories-w<worker>.jsonl`."""

    def __init__(self, output_dir: str | Path, worker_id: int, fraction: float, seed: int):
        self.path = RunLayout(Path(output_dir)).trajectories(worker_id)
        self.fraction, self.seed = fraction, seed
        self.skipped = 0  # lines the file could not take (a full disk): the buffer's log holds the trajectories

    def write(self, traj: Trajectory) -> None:
        """Append the trajectory's line if it is in the sample. A line the file cannot take (a full disk, a
        lost mount) is skipped with one warning: this file is for reading runs, the buffer's acked log is
        their record, and the episode must not fail over it."""
        if not selected(traj.uid, self.fraction, self.seed):
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(trajectory_record(traj), default=str) + "\n")
        except OSError as e:
            if not self.skipped:
                log.warning("%s: %s; trajectory lines are skipped while it fails (the buffer's log keeps them)",
                            self.path, e)
            self.skipped += 1
