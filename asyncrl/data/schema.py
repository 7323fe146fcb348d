"""The wire schema: trajectories, groups and batches as msgspec structs.

Arrays travel as raw little-endian bytes with dtype and shape (`Array`), never as Python lists of
floats, so encode-then-decode is bit-exact and cheap. All per-token arrays of a trajectory are
aligned with `response_ids` (one entry per response token).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

_ALLOWED_DTYPES = {"int32", "int64", "uint8", "int8", "float32", "float16", "float64", "bool"}
_LE = {name: np.dtype(name).newbyteorder("<") for name in _ALLOWED_DTYPES}  # built once: the buffer's hot path


class SchemaError(ValueError):
    """A frame or struct that violates the schema (bad dtype, shape/size mismatch, misaligned arrays)."""


class NonFiniteRewardError(SchemaError):
    """A reward the episode cannot be trained on: NaN or infinite (the episode's or a turn's), or beyond
    env.reward.max_abs (asyncrl.envs.base.checked_reward)."""


class Array(msgspec.Struct, frozen=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_numpy(cls, a: np.ndarray) -> Array:
        a = np.ascontiguousarray(a)
        if a.dtype.name not in _ALLOWED_DTYPES:
            raise SchemaError(f"array dtype {a.dtype.name!r} not allowed; allowed: {sorted(_ALLOWED_DTYPES)}")
        return cls(a.dtype.name, tuple(a.shape), a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())

    @classmethod
    def of(cls, values: Any, dtype: str) -> Array:
        return cls.from_numpy(np.asarray(values, dtype=dtype))

    def numpy(self) -> np.ndarray:
        if self.dtype not in _ALLOWED_DTYPES:
            raise SchemaError(f"array dtype {self.dtype!r} not allowed; allowed: {sorted(_ALLOWED_DTYPES)}")
        dt = _LE[self.dtype]
        n = math.prod(self.shape)
        if n * dt.itemsize != len(self.data):
            raise SchemaError(f"array of shape {self.shape} {self.dtype} needs {n * dt.itemsize} bytes, got {len(self.data)}")
        return np.frombuffer(self.data, dtype=dt).reshape(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


_FIELDS = (("prompt_ids", "int32"), ("response_ids", "int32"), ("loss_mask", "uint8"),
           ("behavior_logprobs", "float32"), ("versions", "int32"))  # the per-trajectory arrays and their dtypes


MAX_EPISODE_CHAINS = 256  # trajectories one episode may split into (bounds what a group waits for)


class Trajectory(msgspec.Struct, kw_only=True):
    """One finished episode: the unit that flows from a rollout worker through the buffer to the learner."""

    uid: str  # unique per episode; the buffer stores a uid once
    group_id: str  # shared by the n samples of one prompt
    group_size: int  # n_samples the group was started with
    env: str
    agent: str
    prompt_ids: Array  # int32 [P]
    response_ids: Array  # int32 [R]: generated tokens and inserted (tool, user, scaffolding) tokens
    loss_mask: Array  # uint8 [R]: 1 exactly on tokens the policy generated
    behavior_logprobs: Array  # float32 [R]: engine logprob of each generated token, 0 elsewhere
    versions: Array  # int32 [R]: policy version that generated each token, -1 on inserted tokens
    reward: float
    turn_rewards: list[float] = []  # interaction scores, one per interaction turn
    # where each turn reward arose: the response index of the last generated token of the turn it scores
    # (-1 for one, or the list empty: not placed; per-turn credit then puts it at the last generated token)
    turn_reward_positions: list[int] = []
    tool_rewards: list[float] = []  # the tools' rewards, one per call, in call order
    tool_reward_positions: list[int] = []  # ... and, likewise, the last generated token of the calling turn
    num_turns: int = 0
    finish_reason: str = "stop"  # stop | length | abort | max_turns | invalid_calls | error
    metrics: dict[str, float] = {}
    messages: list[dict[str, Any]] = []  # readable conversation for the viewer
    data_index: int = -1  # position of the prompt in the dataset (resume bookkeeping)
    sample_index: int = 0  # index within the group
    # trajectories its episode produced (this one among them, all with the episode's sample_index): an
    # agent may split an episode (openai_agent when the agent rewrote its history); the buffer counts
    # the group complete once every one of them arrived (asyncrl/buffer/store.py, episode chains)
    episode_chains: int = 1

    def validate(self) -> Trajectory:
        """The one check of a trajectory (the buffer runs it on every PUT, the learner on every batch):
        non-empty uid and group_id, 1-D arrays of the schema's dtypes whose bytes match their shapes,
        per-token arrays aligned with response_ids, finite reward, turn rewards and behaviour logprobs.
        Raises SchemaError (NonFiniteRewardError for a reward) naming the field."""
        if not self.uid or not self.group_id:
            raise SchemaError(f"trajectory needs a non-empty uid and group_id, got uid={self.uid!r} "
                              f"group_id={self.group_id!r}")
        for name, dtype in _FIELDS:
            a = getattr(self, name)
            if a.dtype != dtype or len(a.shape) != 1 or len(a.data) != a.shape[0] * _LE[dtype].itemsize:
                raise SchemaError(f"trajectory {self.uid}: {name} must be 1-D {dtype} with matching bytes, got "
                                  f"{a.dtype} shape {a.shape} with {len(a.data)} bytes")
        r = len(self.response_ids)
        for name in ("loss_mask", "behavior_logprobs", "versions"):
            n = len(getattr(self, name))
            if n != r:
                raise SchemaError(f"trajectory {self.uid}: {name} has {n} entries, response_ids has {r}")
        if not 1 <= self.episode_chains <= MAX_EPISODE_CHAINS:
            raise SchemaError(f"trajectory {self.uid}: episode_chains must be in [1, {MAX_EPISODE_CHAINS}], got "
                              f"{self.episode_chains}")
        if not math.isfinite(self.reward):
            raise NonFiniteRewardError(f"trajectory {self.uid}: reward is {self.reward}, not a finite number")
        mask = self.loss_mask.numpy()
        for kind in ("turn", "tool"):
            rewards, positions = getattr(self, f"{kind}_rewards"), getattr(self, f"{kind}_reward_positions")
            bad = [k for k, x in enumerate(rewards) if not math.isfinite(x)]
            if bad:
                raise NonFiniteRewardError(f"trajectory {self.uid}: {kind}_rewards[{bad[0]}] is "
                                           f"{rewards[bad[0]]}, not a finite number")
            if positions and len(positions) != len(rewards):
                raise SchemaError(f"trajectory {self.uid}: {kind}_reward_positions has {len(positions)} entries, "
                                  f"{kind}_rewards has {len(rewards)} (one position per reward, or none)")
            for k, p in enumerate(positions):
                if p != -1 and not (0 <= p < r and mask[p]):
                    raise SchemaError(f"trajectory {self.uid}: {kind}_reward_positions[{k}]={p} is not the index "
                                      f"of a generated token (response has {r} tokens) nor -1 (unplaced)")
        lp = self.behavior_logprobs.numpy()
        bad_lp = np.flatnonzero(~np.isfinite(lp))
        if bad_lp.size:
            raise SchemaError(f"trajectory {self.uid}: behavior_logprobs[{bad_lp[0]}] is {lp[bad_lp[0]]}, "
                              "not a finite number")
        return self

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def min_version(self) -> int:
        """Oldest policy version among generated tokens (the staleness of the trajectory)."""
        v = self.versions.numpy()
        m = self.loss_mask.numpy() != 0
        gen = v[m]
        return int(gen.min()) if gen.size else int(v.max(initial=0))


class Group(msgspec.Struct, kw_only=True):
    """The samples of one prompt. `trajectories` holds the members that arrived; its length is the
    real group size used to normalize advantages (failed or filtered members are not padded in)."""

    group_id: str
    trajectories: list[Trajectory]
    expected: int
    failed: int = 0


class Batch(msgspec.Struct, kw_only=True):
    batch_id: int
    groups: list[Group]

    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes, type: Any = Trajectory) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=type)
    except msgspec.DecodeError as e:
        raise SchemaError(f"cannot decode {getattr(type, '__name__', type)}: {e}") from e


def make_trajectory(
    *,
    uid: str,
    group_id: str,
    prompt_ids: list[int],
    response_ids: list[int],
    loss_mask: list[int],
    behavior_logprobs: list[float],
    versions: list[int],
    reward: float,
    group_size: int = 1,
    env: str = "",
    agent: str = "",
    **extra: Any,
) -> Trajectory:
    """Build a validated Trajectory from Python lists (the agent loops' accumulation format)."""
    return Trajectory(
        uid=uid,
        group_id=group_id,
        group_size=group_size,
        env=env,
        agent=agent,
        prompt_ids=Array.of(prompt_ids, "int32"),
        response_ids=Array.of(response_ids, "int32"),
        loss_mask=Array.of(loss_mask, "uint8"),
        behavior_logprobs=Array.of(behavior_logprobs, "float32"),
        versions=Array.of(versions, "int32"),
        reward=float(reward),
        **extra,
    ).validate()


__all__ = ["Array", "Trajectory", "Group", "Batch", "SchemaError", "encode", "decode", "make_trajectory"]
