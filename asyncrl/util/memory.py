"""A process's resident memory as Linux counts it: now (VmRSS) and its peak (VmHWM), in GiB.

The peak is reset with `reset_peak()` (writing 5 to /proc/self/clear_refs, Linux 4.0+, allowed to any
user for its own process), so a role measures the peak of one step rather than of its whole life: the
learner's `memory/learner_peak_gb` is the peak of the step it reports. Where /proc is not there (not
Linux), the peak is getrusage's ru_maxrss (the life's peak) and the reset does nothing.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

GIB = 2**30


def _status_kb(pid: int | str, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_gb(pid: int | str = "self") -> float:
    """The peak resident memory of `pid` (this process by default) since it started or `reset_peak()`."""
    kb = _status_kb(pid, "VmHWM")
    if kb is None and pid == "self":
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss / (GIB if sys.platform == "darwin" else GIB / 1024)  # bytes on macOS, KiB on Linux
    return (kb or 0) / (GIB / 1024)


def rss_gb(pid: int | str = "self") -> float:
    """The resident memory of `pid` now (0.0 when it cannot be read: gone, or another user's)."""
    return (_status_kb(pid, "VmRSS") or 0) / (GIB / 1024)


def reset_peak() -> bool:
    """Start this process's peak again from its current resident memory; False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemoryBudgetExceeded(RuntimeError):
    """The machine's memory passed `trainer.memory_stop_fraction` while a process of the run checked it."""


def machine_used() -> tuple[float, float]:
    """(used fraction, total GiB) of the memory this process's processes share: the cgroup's limit where
    one is set (cgroup v2 memory.max; what a container gets), else the machine's (MemTotal - MemAvailable)."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            current = int(Path("/sys/fs/cgroup/memory.current").read_text())
            return current / int(limit), int(limit) / GIB
    except (OSError, ValueError):
        pass
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    total = info.get("MemTotal", 0)
    if not total or "MemAvailable" not in info:
        return 0.0, 0.0
    return 1 - info["MemAvailable"] / total, total / (GIB / 1024)


def over_memory_stop(stop_fraction: float, who: str, advice: str) -> MemoryBudgetExceeded | None:
    """The MemoryBudgetExceeded to raise, naming `who` (this process's role), its resident memory and `advice`
    (the settings that would lower it), when the machine's used fraction is at `stop_fraction` or above;
    None below it, or when `stop_fraction` >= 1 (never). One reading of the machine's memory."""
    if stop_fraction >= 1:
        return None
    used, total = machine_used()
    if used < stop_fraction:
        return None
    return MemoryBudgetExceeded(
        f"{who}: the machine's memory is {used:.0%} used ({used * total:.1f} of {total:.1f} GiB), at or over "
        f"trainer.memory_stop_fraction={stop_fraction:g}, while this process holds {rss_gb():.2f} GiB "
        f"(peak {peak_gb():.2f} GiB); {advice}")


def check_machine_memory(stop_fraction: float, who: str, advice: str) -> None:
    """Raise `over_memory_stop`'s error when there is one. Ray's memory monitor kills workers at its own
    threshold (0.95 by default) with no word of why; the run stops itself first, saying which process held
    what."""
    if (e := over_memory_stop(stop_fraction, who, advice)) is not None:
        raise e
