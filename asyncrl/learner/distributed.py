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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.net import free_port


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
