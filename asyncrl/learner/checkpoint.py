"""Atomic training checkpoints through torch.distributed.checkpoint (DCP).

Layout of a checkpoint directory:
  DCP files (.metadata, __*_*.distcp)   model + optimizer state, sharded as trained (resharding on load)
  rng_rank{r}.pt                        python / numpy / torch (and CUDA) RNG states of rank r
  meta.pt                               step, version, scheduler state, the caller's `extra`
  config.json                           the run's Config as a dict (export rebuilds the model from it)
  COMPLETE                              written last; a directory without it is never loaded

Atomicity: every rank writes into `<path>.tmp`; after a barrier rank 0 writes COMPLETE, fsyncs, and
renames the directory to `<path>` (a previous `<path>` is first moved to `<path>.old` and deleted after).
A crash at any point leaves either no `<path>`, or a complete one: never a half-written one that loads.

Naming is asyncrl/run_dir.py's, the owner of the run directory's layout: a run's checkpoints live under
`<output_dir>/checkpoints/` (`RunLayout.checkpoints`), one directory `step_NNNNNN` per checkpoint
(`checkpoint_name`, `step_dir`; `checkpoint_step` parses one), a critic's part beside it (`critic_dir`);
`latest_checkpoint` finds the newest. Here `prune_checkpoints` keeps the newest `keep`. Only the run holding
the directory's lock (asyncrl/run_dir.py) writes or prunes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.run_dir import RunLayout, checkpoint_dirs, critic_dir
from asyncrl.run_dir import latest_checkpoint as latest_checkpoint  # re-exported: the naming is run_dir's
from asyncrl.run_dir import step_dir as step_dir
from asyncrl.util.durable import free_bytes, fsync_dir, full_errno

MARKER = "COMPLETE"


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    """`RunLayout(output_dir).checkpoints`, for this module's callers."""
    return RunLayout(Path(output_dir)).checkpoints


def checkpoint_version(path: str | os.PathLike) -> int:
    """The policy version a complete checkpoint holds (its meta.pt), without loading the model."""
    meta = torch.load(check_complete(path) / "meta.pt", weights_only=False)
    return int(meta["version"])


def prune_checkpoints(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints under `root` (keep <= 0: delete none), with their critics."""
    found = checkpoint_dirs(root)
    for _, p in found[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(critic_dir(p), ignore_errors=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load; one process is a supported case here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, incomplete or inconsistent with the model."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         meta: dict[str, Any], config: dict | None = None,
         modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None) -> Path:
    """Collective: every rank calls it. Writes model + optimizer (DCP), per-rank RNG, and `meta` (rank 0);
    `modules` (e.g. {"critic": (model, optimizer)}) go into the same DCP save under their names, so they
    are committed by the same marker and rename as the policy.

    A write that fails on any rank fails the save on every rank (no rank is left waiting at a barrier):
    `<path>.tmp` is removed, `<path>` and older checkpoints are as they were, and every rank raises
    `CheckpointDiskFull` when any found the disk (or quota) full, else its own error (`CheckpointError` on
    the ranks that only learned of another's failure)."""
    # lazy: imports DCP (DTensor, sympy: most of a second), which the driver's uses of this module do not need
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    failure: BaseException | None = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crashed save
            tmp.mkdir(parents=True)
        except Exception as e:
            failure = e
    _stop_if_any_failed(final, tmp, failure)  # also the barrier before any rank writes into tmp
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        for name, (m, o) in (modules or {}).items():
            state[name], state[f"{name}_optim"] = get_state_dict(m, o)
        with _quiet():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        _write(tmp / f"rng_rank{rank}.pt", rng_state())
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        failure = e
    _stop_if_any_failed(final, tmp, failure)
    try:
        if rank == 0:
            _write(tmp / "meta.pt", meta)
            if config is not None:
                (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
            with open(tmp / MARKER, "w") as f:
                f.write("ok\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            old = final.with_name(final.name + ".old")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            shutil.rmtree(old, ignore_errors=True)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        failure = e
    _stop_if_any_failed(final, tmp, failure)
    return final


class CheckpointDiskFull(CheckpointError):
    """A checkpoint save that found its disk (or quota) full; nothing of the new checkpoint was kept."""


_OK, _FAILED, _DISK_FULL = 0, 1, 2


# torch's own writer reports a short write on a full disk as "unexpected pos" (a RuntimeError without an
# errno): a failed write on a device with less than this free is taken as the disk being full
FULL_BELOW_BYTES = 4 << 20


def _is_full(failure: BaseException, where: Path) -> bool:
    if full_errno(failure) is not None:
        return True
    try:
        return free_bytes(where) < FULL_BELOW_BYTES
    except OSError:
        return False


def _worst(failure: BaseException | None, where: Path) -> int:
    """The worst outcome over the ranks (collective; this rank's own without a process group): _OK,
    _FAILED, or _DISK_FULL when any rank found the disk full (`where`: a dir on the checkpoint's device)."""
    mine = _OK if failure is None else _DISK_FULL if _is_full(failure, where) else _FAILED
    if not dist.is_initialized():
        return mine
    flag = torch.tensor([mine], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _stop_if_any_failed(final: Path, tmp: Path, failure: BaseException | None) -> None:
    """Collective, after each phase of a save: nothing when no rank failed; else remove the failed save's
    `<path>.tmp` (rank 0, after every rank stopped writing) and raise, on every rank `CheckpointDiskFull` when
    any rank found the disk full, else this rank's own error."""
    worst = _worst(failure, final.parent)
    if worst == _OK:
        return
    _barrier()
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    if worst == _DISK_FULL:
        try:
            free = f"{free_bytes(final.parent) / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        raise CheckpointDiskFull(f"no space left on the device of {final.parent} writing checkpoint {final.name} "
                                 f"({free} after removing what it had written); nothing of it was kept") \
            from None
    if failure is None:
        raise CheckpointError(f"checkpoint {final} was not written: another rank's write failed")
    raise failure


def check_complete(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}")
    if not (p / MARKER).is_file():
        raise CheckpointError(f"checkpoint {p} is incomplete (no {MARKER} marker): a save did not finish; "
                              f"use an earlier checkpoint")
    return p


def read_config(path: str | os.PathLike) -> dict:
    p = check_complete(path) / "config.json"
    if not p.is_file():
        raise CheckpointError(f"checkpoint {path} holds no config.json; cannot rebuild its model")
    return json.loads(p.read_text())


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None) -> dict[str, Any]:
    """Collective: load model (+ optimizer, + `modules`, + this rank's RNG) in place; returns the saved `meta`.
    A checkpoint that lacks one of `modules` (saved by a run without a critic) is a CheckpointError."""
    # lazy: imports DCP (DTensor, sympy: most of a second), which the driver's uses of this module do not need
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    p = check_complete(path)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    for name, (m, o) in (modules or {}).items():
        state[name], state[f"{name}_optim"] = get_state_dict(m, o)
    if modules:
        saved = dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata
        for name in modules:
            if not any(k.startswith(f"{name}.") for k in saved):
                raise CheckpointError(f"checkpoint {p} holds no {name} state (saved by a run without one); "
                                      f"resume it with the same algorithm, or start afresh")
    with _quiet():
        dcp.load(state, checkpoint_id=str(p), no_dist=not dist.is_initialized())
    for name, (m, o) in (modules or {}).items():
        set_state_dict(m, o, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    rng_file = p / f"rng_rank{_rank()}.pt"
    if optimizer is not None:
        set_rng_state(torch.load(rng_file if rng_file.is_file() else p / "rng_rank0.pt", weights_only=False))
    return torch.load(p / "meta.pt", weights_only=False)
