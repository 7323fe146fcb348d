"""How one machine's CPU cores are split between CPU inference engines and learner ranks.

Ray leaves each actor one thread (OMP_NUM_THREADS=1); the controller gives every engine and learner
rank an explicit torch thread count from here instead.
"""

from __future__ import annotations

import os


def available_cpus() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(mode: str, cpus: int, engines: int, learner_ranks: int) -> tuple[int, int]:
    """Torch CPU threads for each engine and each learner rank sharing one machine's `cpus` cores.

    async: engines and learner run at the same time, so they split the cores (half each, the learner
    half getting the odd one); sync: they take turns, so each may use every core. Ray would
    otherwise give each actor one thread, which starves the synchronous baseline of half a 2-core
    machine and skews any async/sync comparison.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
    if cpus < 1 or engines < 1 or learner_ranks < 1:
        raise ValueError(f"cpus, engines and learner_ranks must be >= 1, got {cpus}, {engines}, {learner_ranks}")
    if mode == "sync":
        return max(1, cpus // engines), max(1, cpus // learner_ranks)
    engine_share = cpus // 2
    return max(1, engine_share // engines), max(1, (cpus - engine_share) // learner_ranks)


def native_bf16() -> bool:
    """The CPU computes bf16 natively (the avx512_bf16 or amx_bf16 flag in /proc/cpuinfo); elsewhere torch
    emulates bf16, slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))
