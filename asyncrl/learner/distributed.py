"""Process groups for the learner ranks, and a local launcher for N CPU ranks.

The controller creates ranks as Ray actors with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set and
initializes the default group itself; `init_distributed` does the same from those variables when
nothing did (gloo on CPU, NCCL on GPU). `spawn(fn, world_size, *args)` runs fn(rank, world_size,
*args) in `world_size` fresh processes (torch.multiprocessing, start method "spawn") rendezvousing on
a free loopback port: the way tests and benchmarks get multi-rank runs on one machine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from asyncrl.models import default_device, fsdp_mixed_precision
from asyncrl.util.net import free_port

if TYPE_CHECKING:
    from asyncrl.models import Precision


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_distributed(rank: int, world_size: int, device: str = "cpu", timeout_s: float | None = None) -> None:
    """Join the default process group (env:// rendezvous) unless already joined or world_size == 1. A
    collective that waits longer than `timeout_s` (a peer died or hangs) raises instead of waiting forever
    (None: torch's default)."""
    if world_size <= 1 or dist.is_initialized():
        if dist.is_initialized() and dist.get_world_size() != world_size:
            raise RuntimeError(f"the default process group has {dist.get_world_size()} ranks, world_size={world_size}")
        return
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"world_size={world_size} needs {var} in the environment (set by the launcher)")
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s) if timeout_s else None)


def rank_device() -> str:
    """This rank's device: its GPU (LOCAL_RANK, made current) where CUDA is available, else "cpu"."""
    device = default_device()
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    return device


def shard_fsdp2(model: torch.nn.Module, world_size: int, p: Precision) -> None:
    """FSDP2 over the default group's ranks (each decoder block, then the whole) with `p`'s mixed precision
    (asyncrl.models.fsdp_mixed_precision); nothing with one rank. The one way the learner and a critic of its
    own shard their models."""
    if world_size == 1:
        return

    mp_policy = fsdp_mixed_precision(p)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise RuntimeError(f"{type(model).__name__}: no decoder blocks found to shard (_no_split_modules={block_names})")
    for block in blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)


def comm_device(device: str) -> str:
    return device if dist.get_backend() == "nccl" else "cpu"


def max_over_ranks(n: int, world_size: int, device: str) -> int:
    """The largest `n` of all ranks (collective)."""
    if world_size == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=comm_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_dict(d: dict[int, torch.Tensor], world_size: int) -> dict[int, torch.Tensor]:
    """Every rank's {index: tensor} merged (collective); `d` itself with one rank."""
    if world_size == 1:
        return d
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, {k: v.numpy() for k, v in d.items()})
    return {k: torch.from_numpy(v) for p in parts for k, v in p.items()}


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_distributed(rank, world_size, "cpu")
        fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.barrier()  # no rank tears its group down while a peer is still inside a collective
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A clean return ends the rank without interpreter finalization: gloo's C++ threads can still be
    # joinable while static objects are destroyed, and a rank that returned normally then died of
    # std::terminate (SIGABRT, "terminate called without an active exception"; seen once in CI). A rank
    # that raised takes the normal path, so that torch.multiprocessing records its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run fn(rank, world_size, *args) on `world_size` CPU ranks over gloo; raises if any rank fails.

    fn must be importable (a module-level function) since each rank is a fresh interpreter.
    """
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
