"""Isolation of model-written programs (used by the `python` tool).

The boundary is the kernel's namespaces and credentials, not anything inside the interpreter:
each run gets its own user, mount, PID, network, IPC and UTS namespaces (made with unshare(2) by
`nsinit.py`, no helper binary and no privilege needed: unprivileged user namespaces suffice). In it
the program runs as uid 65534 (with no capabilities, no_new_privs) and sees a read-only view of the
host root in which /tmp, /var/tmp, /run, /home, /root, /mnt, /media, /srv, /dev/shm, the episode
directory and configured paths are empty read-only tmpfs, /proc belongs to the new PID namespace
(no other process is visible, let alone its environment), /dev holds only null, zero, full,
random and urandom, and one size- and inode-capped tmpfs (/tmp/work) is the only writable place.
The network namespace has no interfaces up (not even loopback), so no socket reaches anything.
RLIMIT_NPROC/AS/CPU/FSIZE/NOFILE/CORE bound what each process can spend, the init relays capped output,
enforces the wall clock and the resident total of all the call's processes (read from the namespace's
/proc every 20 ms: `Limits.memory_total_mb`), and, when the program ends, kills every process of the
namespace before its files are copied back (regular files and directories only; links are never followed).

What it does not cover: host files readable by "other" stay readable (the view is the host's root,
read-only); CPU time across the allowed processes is bounded only per process (RLIMIT_CPU; no cgroup is
used), and the resident total can overshoot by what the processes touch within one 20 ms poll; a unix
socket file in a visible directory can
be connected to if its mode lets "other" write it; when only one uid can be mapped (an ordinary
user), the program keeps that user's file permissions on the read-only view; kernel bugs are out of
scope (no seccomp filter).

`runner.py` is the host side (episode dirs, probe, one run); `nsinit.py` runs in the namespaces.
"""
