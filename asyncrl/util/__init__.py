"""Small helpers with no knowledge of RL: addresses and ports (`net`), atomic writes (`durable`), CPU
counts (`cpus`), how long-running commands stop on signals (`stop_signals`),
the engine token and the gate that checks it (`auth`)."""
