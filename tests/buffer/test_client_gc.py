"""A buffer client dropped without close() never blocks the garbage collector (asyncrl/buffer/client.py).

A client that owned its ZMQ context and ended in a reference cycle hung the process: the collector clears
the weak references by which a context finds its sockets before the context's __del__ runs term(), which
then waits forever for the sockets it can no longer close (a later test hung 300 s in the collector). Run
in a child process, since the failure is a hang."""

from __future__ import annotations

import subprocess
import sys

CHILD = r'''
import asyncio, gc
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer

for i in range(20):  # nobody listens on port 9: the sockets hold a pending connect
    c = BufferConsumer("tcp://127.0.0.1:9", timeout_s=1.0)
    c.me = c  # a reference cycle: only the collector frees it

async def producers():
    for i in range(20):
        p = AsyncBufferProducer("tcp://127.0.0.1:9", timeout_s=1.0)
        p._ensure()
        p.me = p

asyncio.run(producers())
del c
gc.collect()
print("collected", flush=True)
'''


def test_clients_dropped_in_a_reference_cycle_never_block_the_collector():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "collected" in r.stdout, r.stderr[-2000:]
