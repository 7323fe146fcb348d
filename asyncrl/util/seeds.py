"""Sampling seeds fixed by the numbers that name an episode: one rule for training and evaluation.

An episode's assistant turn t samples with seed `s + t` (asyncrl/agents/base.py), where s comes from here:
- training (asyncrl/rollout/worker.py): `derive_seed(run seed, prompt position, issue, sample index)`,
  where the issue counts re-issues of a group dropped unserved; a failed episode's retry a (1, 2, ...)
  samples with `derive_seed(that seed, a)`. So every draw of a run gets its own seed, and the same draws
  in another run (a resume, the sync baseline, a replay of a bug) get the same seeds, whatever the
  timing or the worker that ran them;
- evaluation (asyncrl/offline/session.py): `derive_seed(seed, row, sample index)`, the same for every
  checkpoint.

Seeds lie in [0, 2**56), so s + t stays far inside the int64 range both engines accept. Each request
samples from its own generator seeded with it (the embedded engine always; SGLang only under
`--enable-deterministic-inference`, where an unseeded request gets seed 42, so without these seeds
every member of a group would draw the same tokens). The draws repeat exactly where the logits do: a
token's probabilities depend on float rounding, which batching changes (docs/design.md, "Seeds").
"""

from __future__ import annotations

import hashlib

SEED_BITS = 56


def selected(uid: str, fraction: float, seed: int) -> bool:
    """Whether the trajectory `uid` is in the run's `fraction` sample (trainer.dump_trajectories): fixed by the
    uid and the run's seed, so the rollout worker that writes its line and the learner that writes its
    log-probs (asyncrl/learner/worker.py) pick the same trajectories without telling each other."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    digest = hashlib.blake2b(f"{seed}:{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2 ** 64


def derive_seed(*parts: int) -> int:
    """A seed in [0, 2**SEED_BITS) fixed by `parts` (distinct tuples, lengths included, give independent seeds)."""
    if not parts or not all(isinstance(p, int) and not isinstance(p, bool) for p in parts):
        raise TypeError(f"derive_seed takes one or more ints, got {parts!r}")
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=SEED_BITS // 8).digest()
    return int.from_bytes(digest, "big")
