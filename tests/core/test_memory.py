"""asyncrl/util/memory.py on this process and this machine: resident memory and its resettable peak, the
machine's used fraction, and the stop that names who found the machine too full."""

from __future__ import annotations

import mmap

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.util.memory import (
    MemoryBudgetExceeded,
    check_machine_memory,
    machine_used,
    peak_gb,
    reset_peak,
    rss_gb,
)


def test_the_peak_follows_a_large_block_and_starts_again_when_reset():
    assert reset_peak()
    before = rss_gb()
    # fresh pages of its own (a malloc'd block may reuse pages an earlier test left resident in this worker)
    block = mmap.mmap(-1, 300 * 2**20)
    for i in range(0, len(block), 4096):  # touch every page: resident
        block[i] = 1
    assert peak_gb() >= before + 0.25 and rss_gb() >= before + 0.25
    block.close()
    assert reset_peak()
    assert peak_gb() <= rss_gb() + 0.05  # the old peak is gone: the new one starts at what is resident now
    assert rss_gb(pid=999_999_999) == 0.0  # no such process: nothing, rather than an error


def test_the_machines_used_fraction_is_a_fraction_of_its_memory():
    used, total = machine_used()
    assert 0 < used < 1 and total > 1


def test_the_stop_names_the_process_its_memory_the_setting_and_the_advice():
    check_machine_memory(1.0, "learner rank 0", "lower x")  # 1: never
    with pytest.raises(MemoryBudgetExceeded) as e:
        check_machine_memory(0.0001, "learner rank 0", "lower algorithm.micro_batch_tokens (now 4096)")
    msg = str(e.value)
    assert msg.startswith("learner rank 0: the machine's memory is ")
    assert "trainer.memory_stop_fraction=0.0001, while this process holds " in msg
    assert msg.endswith("; lower algorithm.micro_batch_tokens (now 4096)")


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan"])
def test_a_memory_stop_outside_0_to_1_is_refused_at_load(value):
    with pytest.raises(ConfigError, match=r"trainer.memory_stop_fraction.*must be in \(0, 1\]"):
        load_config([f"trainer.memory_stop_fraction={value}"])
