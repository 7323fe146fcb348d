"""Typed state that crosses processes between the controller, the learner and the rollout workers.

msgspec Structs, so a field that is missing or of the wrong type fails where it is decoded, naming
the field, instead of travelling on as an untyped dict:

- `RolloutPosition`: where one rollout worker is in its prompt shard; what a restarted worker (after
  a crash, or on resume) starts from.
- `RolloutState`: what a rollout worker reports at each health check: its position, its counters, the
  outcomes of its last episodes and a bounded count of its episodes' errors (what the watchdog quotes).
- `JobState`: the controller's part of a checkpoint (the learner adds its own: weights, optimizer and
  the policy version, which it owns). Written by `LearnerGroup.save_checkpoint`, read back on resume.
- `StepResult`: what one training step returns (rank 0): the learner's new policy version (the only
  source of the version for everyone else), the batch it trained and the uids in it, the metrics.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RolloutPosition(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    next_position: int | None = None  # the next prompt position to draw; None: the shard's first
    started_groups: int = 0  # groups started so far (the admission gate's count)
    inflight_positions: list[int] = []  # started, not all acked by the buffer: re-issued on restart
    # groups the buffer closed unserved (all members failed or stale), as handled by the worker:
    returned_groups: int = 0  # starts given back to the gate (admission counts started - returned)
    retries: dict[int, int] = {}  # position -> drop reports handled for it = retry number of its next group
    waiting_positions: list[int] = []  # returned, to be issued again (through the gate) before new draws
    prompts_skipped: int = 0  # prompts given up after trainer.max_prompt_retries re-issues


class EpisodeError(msgspec.Struct, frozen=True, kw_only=True):
    """One distinct error text among a worker's failed episodes: how often, and the first row it came from."""

    message: str
    count: int
    data_index: int


class RolloutState(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: int
    position: RolloutPosition
    episodes: int = 0
    episode_errors: int = 0
    episodes_failed: int = 0
    reward_nonfinite: int = 0  # episodes failed because the reward function gave NaN or inf
    reward_model_failures: int = 0  # episodes the reward model gave no verdict for (asyncrl/rollout/reward_model.py)
    groups_started: int = 0
    groups_done: int = 0
    groups_dropped: int = 0  # drop reports applied (groups the buffer closed unserved)
    groups_filtered: int = 0  # ... of which closed by dynamic sampling (rewards all equal): their prompts done
    prompts_reissued: int = 0
    reward_sum: float = 0.0
    engine_in_flight: int = 0
    engine_tokens_out: int = 0
    recent_episodes: int = 0  # outcomes in the worker's window of its last episodes (trainer.failed_episode_window)
    recent_failed: int = 0  # ... of which failed
    errors: list[EpisodeError] = []  # failed episodes' last error, by message, most frequent first (bounded)
    rss_gb: float = 0.0  # the worker process's resident memory when it reported


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    step: int  # training steps taken (the checkpoint's name)
    rollout: list[RolloutPosition]  # one per rollout worker, by worker id
    trained_batch_ids: list[int] = []  # batches trained since the previous checkpoint: committed with this one

    def to_builtins(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def from_builtins(cls, data: object) -> JobState:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"checkpoint job state is not a JobState: {e}") from e


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    version: int  # the learner's policy version after this step
    batch_id: int
    trained_uids: list[str]
    metrics: dict[str, float]
    # a critic on its own ranks: (returns, old values) per trajectory, the targets of its update (rank 0's)
    critic_targets: Any = None
    # {uid, proximal_logprobs} of the trained trajectories in the dump sample (LearnerWorker.token_logprobs)
    token_logprobs: list[dict] = msgspec.field(default_factory=list)
