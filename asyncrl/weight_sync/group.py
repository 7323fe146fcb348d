"""The dedicated weight-update process group, built exactly the way SGLang builds its own.

SGLang's `init_custom_process_group` (sglang/srt/utils) does not use the default group: it runs a
`tcp://host:port` rendezvous (rank 0 hosts the TCPStore), wraps the store in
`PrefixStore(group_name, store)` and calls `_new_process_group_helper` with that store. Both sides
of a sync must do the same, or the store keys differ and both hang. Our sender (rank 0) and our
receiver (ranks rank_offset..) call this one function, so our sender also talks to a real SGLang.
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

log = logging.getLogger(__name__)


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: float | timedelta,
) -> Any:
    """Join (rank 0: host) the group `group_name` of `world_size` ranks at `init_method` (tcp://h:p).

    Blocks until all ranks arrived or `timeout` (seconds) passed; the same timeout bounds every
    collective of the returned group, so a dead peer turns into an error, never a hang."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-update group {group_name!r}: backend {backend!r} is not gloo or nccl")
    if not (0 <= rank < world_size):
        raise ValueError(f"weight-update group {group_name!r}: rank {rank} not in [0, {world_size})")
    if not init_method.startswith("tcp://"):
        raise ValueError(f"weight-update group {group_name!r}: init_method {init_method!r} is not tcp://host:port")
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=td))
    store.set_timeout(td)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    opts = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=td, **{opts: None}
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    """Forget `pg` (idempotent; errors from an already broken group are swallowed)."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception as e:  # noqa: BLE001 - a group broken by a dead peer may refuse a clean shutdown
        log.debug("destroying weight-update group: %s", e)
