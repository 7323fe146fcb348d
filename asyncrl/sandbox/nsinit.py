"""The trusted launcher and init of one sandboxed run (stdlib only; run as `python -I -S nsinit.py JSON`).

It is started by `asyncrl.sandbox.runner` and is the only code that holds privileges inside the sandbox:

1. launcher (the host's child): forks a helper that stays in the host's user namespace, enters a new
   user namespace, and has the helper write its uid/gid maps (root: ns 0 -> 0 and ns 65534 -> 65534
   when that can be written; otherwise ns 0 -> our own uid only). Then it enters new mount, PID, network, IPC
   and UTS namespaces and forks the init. It waits for the init and exits with its status; when the
   launcher dies the init gets SIGKILL (PR_SET_PDEATHSIG), and the kernel kills every process of a
   PID namespace whose PID 1 dies.
2. init (PID 1 of the new PID namespace, root of the new user namespace): builds the view — the host
   root bound read-only (recursively, nosuid), a fresh /proc of the new PID namespace, a minimal /dev,
   empty read-only tmpfs over /tmp /var/tmp /run /home /root /mnt /media /srv /dev/shm and the
   configured `hide` paths (and `hide_files`, each covered by /dev/null), the interpreter's install
   tree bound back read-only where a mask hid it,
   and one size- and inode-capped tmpfs at /tmp/work, the only writable place — copies the episode's
   files in, pivots into the view and detaches the host root, makes itself non-dumpable, then forks
   the user program: unprivileged identity (uid 65534, or a nested user namespace mapping 65534 to the
   init's uid when 65534 is not mapped), no_new_privs, rlimits, scrubbed environment, new session.
   The init relays its stdout/stderr with a per-stream cap, enforces the wall clock and the call's
   resident total (`limits.total_bytes`: the resident memory of all of the call's processes together,
   read from /proc every `MEMORY_POLL_S`; RLIMIT_AS bounds each process alone), and when the
   program ends (or a limit trips) kills every other process of the namespace and reaps them. Then
   it copies the regular files and directories of /tmp/work (never following links, bounded by the
   tmpfs caps) back to the episode directory and writes `status` (marshal) there.

Setup failures print one line `sandbox: <what is missing>` on stderr and exit with status 97.
"""

from __future__ import annotations

import _signal  # not `signal`: its enums pull in re and enum, 10+ ms of every call
import ctypes
import errno
import marshal
import os
import resource
import select
import stat
import sys
import time
from collections.abc import Callable

SETUP_FAILED = 97
WORK = "/tmp/work"
MASKS = ("/tmp", "/var/tmp", "/run", "/home", "/root", "/mnt", "/media", "/srv")
DEVICES = ("null", "zero", "full", "random", "urandom")
NOBODY = 65534

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH, AT_FDCWD, AT_RECURSIVE = 2, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_MOUNT_SETATTR = 442  # the same number on every architecture

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    pass


def fail(msg: str) -> None:
    os.write(2, f"sandbox: {msg}\n".encode())
    os._exit(SETUP_FAILED)


def check(rc: int, what: str) -> None:
    if rc < 0:
        e = ctypes.get_errno()
        raise SetupError(f"{what} failed: {errno.errorcode.get(e, e)} ({os.strerror(e)})")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    b = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(b(src), b(dst), b(fstype), ctypes.c_ulong(flags), b(data)), f"mount {fstype or src} on {dst}")


def read_sysctl(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def userns_hint() -> str:
    for path, bad in (("/proc/sys/kernel/unprivileged_userns_clone", "0"),
                      ("/proc/sys/user/max_user_namespaces", "0"),
                      ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1")):
        if read_sysctl(path) == bad:
            return f"user namespaces are disabled ({path[len('/proc/sys/'):].replace('/', '.')}={bad})"
    return "user namespaces cannot be created here"


# --- 1. launcher --------------------------------------------------------------------------------

def write_file(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def write_maps(pid: int, uid: int, gid: int) -> None:
    """Map ns 0 to us and, where we may (root of our own namespace), ns 65534 to 65534 as well."""
    p = f"/proc/{pid}"
    rich = f"0 0 1\n{NOBODY} {NOBODY} 1\n"
    if not (uid == 0 and gid == 0 and write_file(f"{p}/gid_map", rich)):
        write_file(f"{p}/setgroups", "deny")
        if not write_file(f"{p}/gid_map", f"0 {gid} 1\n"):
            raise OSError(f"writing {p}/gid_map failed")
    if not (uid == 0 and write_file(f"{p}/uid_map", rich)) and not write_file(f"{p}/uid_map", f"0 {uid} 1\n"):
        raise OSError(f"writing {p}/uid_map failed")


def nobody_is_mapped() -> bool:
    with open("/proc/self/uid_map") as f:
        return any(line.split()[0] == str(NOBODY) for line in f)


def launcher(cfg: dict) -> None:
    if not cfg["isolate"]:
        return run_plain(cfg)
    uid, gid = os.geteuid(), os.getegid()
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:  # stays in the host's user namespace: writes the maps of the launcher
        os.close(go_w)
        ok = os.read(go_r, 1)
        if ok != b"1":
            os._exit(1)
        try:
            write_maps(os.getppid(), uid, gid)
        except OSError as e:
            os.write(2, f"sandbox: writing the user namespace maps failed: {e}\n".encode())
            os._exit(1)
        os._exit(0)
    os.close(go_r)
    rc = libc.unshare(CLONE_NEWUSER)
    err = ctypes.get_errno()
    os.write(go_w, b"1" if rc == 0 else b"0")
    os.close(go_w)
    _, st = os.waitpid(helper, 0)
    if rc != 0:
        fail(f"{userns_hint()}: unshare(CLONE_NEWUSER) failed: {errno.errorcode.get(err, err)}")
    if os.waitstatus_to_exitcode(st) != 0:
        fail("the user namespace maps could not be written")
    try:
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
              "unshare(mount, pid, net, ipc, uts namespaces)")
    except SetupError as e:
        fail(str(e))
    nobody_mapped = nobody_is_mapped()
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
        try:
            init(cfg, nobody_mapped)
        except SetupError as e:
            fail(str(e))
        except BaseException as e:  # noqa: BLE001 - never fall back into the launcher's code
            fail(f"init failed: {e!r}")
        os._exit(0)
    for sig in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):  # the host ends the run with SIGKILL
        _signal.signal(sig, _signal.SIG_IGN)
    _, st = os.waitpid(pid, 0)
    if not os.WIFEXITED(st):
        fail(f"the sandbox init died of signal {os.WTERMSIG(st)}")
    os._exit(os.WEXITSTATUS(st))


# --- 2. init: the view --------------------------------------------------------------------------

def under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def mkdirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def mask(root: str, path: str) -> str | None:
    """Cover a host directory with an empty tmpfs (made read-only later). A path that goes through a
    symlink is skipped: mount(2) would follow it out of the view; its real path is covered or not."""
    target = root + path
    if os.path.realpath(path) != path or not os.path.isdir(target):
        return None
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
    return target


def mask_file(root: str, path: str) -> None:
    """Cover a host file that is still visible in the view with /dev/null (it reads as empty; writes go
    nowhere). A path through a symlink is skipped, as in `mask`; a file under a masked directory is gone
    already."""
    target = root + path
    if os.path.realpath(path) == path and os.path.isfile(target):
        mount("/dev/null", target, None, MS_BIND)


def bind_ro(root: str, host_path: str) -> None:
    """Bind a host directory (hidden by a mask) back into the view at the same path."""
    target = root + host_path
    mkdirs(target)
    mount(host_path, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def build_view(root: str, cfg: dict, uid: int) -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("/", root, None, MS_BIND | MS_REC)
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    rc = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), root.encode(),
                      ctypes.c_uint(AT_RECURSIVE), attr, ctypes.c_size_t(32))
    if rc < 0 and ctypes.get_errno() == errno.ENOSYS:
        raise SetupError("the kernel lacks mount_setattr(2) (Linux >= 5.12 is needed for a read-only view)")
    check(rc, "mount_setattr(read-only, recursive) of the view")
    paths = sorted({*MASKS, cfg["episode_dir"], *cfg["hide"]})
    outermost = [p for p in paths if not any(under(p, q) for q in paths if q != p)]
    masked = [m for m in (mask(root, p) for p in outermost) if m]
    # the interpreter's install trees come back read-only where a mask hid them, and what is to be
    # hidden inside those trees is covered again
    exposed = [t for t in cfg["expose"] if any(under(t, m[len(root):]) for m in masked)]
    for tree in exposed:
        bind_ro(root, tree)
    masked += [m for m in (mask(root, p) for p in paths if any(under(p, t) for t in exposed)) if m]
    for f in cfg.get("hide_files", []):
        mask_file(root, f)
    # /dev: a few harmless devices bound from the host, nothing else
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for d in DEVICES:
        open(f"{root}/dev/{d}", "w").close()
        mount(f"/dev/{d}", f"{root}/dev/{d}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.mkdir(f"{root}/dev/shm")
    masked.append(root + "/dev")
    mkdirs(root + WORK)
    mount("tmpfs", root + WORK, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['scratch_mb']}m,nr_inodes={cfg['scratch_inodes']},mode=0700,uid={uid},gid={uid}")
    for m in masked:
        mount(None, m, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for p in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"):  # the kernel's knobs: read-only
        if os.path.exists(root + p):
            mount(root + p, root + p, None, MS_BIND | MS_REC)
            mount(None, root + p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def pivot(root: str) -> None:
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detaching the host root")
    os.chdir("/")


# --- copying the episode's files ----------------------------------------------------------------

def copy_tree(src_fd: int, dst_fd: int, uid: int | None, budget: list[int], depth: int = 0) -> None:
    """Copy regular files and directories from src_fd into dst_fd; links, devices, fifos and
    sockets are skipped, nothing is followed. `budget` is [files left, bytes left]."""
    if depth > 32:
        return
    for entry in os.scandir(src_fd):
        if budget[0] <= 0 or budget[1] <= 0:
            return
        st = entry.stat(follow_symlinks=False)
        mode = stat.S_IMODE(st.st_mode) & 0o755 | 0o600
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(entry.name, 0o700, dir_fd=dst_fd)
            s = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=src_fd)
            d = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dst_fd)
            try:
                if uid is not None:
                    os.fchown(d, uid, uid)
                copy_tree(s, d, uid, budget, depth + 1)
                os.fchmod(d, mode | 0o700)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISREG(st.st_mode) and st.st_size <= budget[1]:
            budget[0] -= 1
            budget[1] -= st.st_size
            s = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_fd)
            d = os.open(entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dst_fd)
            try:
                if not stat.S_ISREG(os.fstat(s).st_mode):
                    continue
                if uid is not None:
                    os.fchown(d, uid, uid)
                while chunk := os.read(s, 1 << 20):
                    os.write(d, chunk)
            finally:
                os.close(s)
                os.close(d)


# --- 2. init: the run ---------------------------------------------------------------------------

def drop_and_exec(cfg: dict, identity: str, out_w: int, err_w: int) -> None:
    """In the forked child: become an unprivileged user (identity "nobody" or "nested"; "plain": stay
    who we are, the unisolated mode) with limits, then exec the program."""
    try:
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.setsid()
        if identity == "nobody":
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
        elif identity == "nested":  # only our own uid is mapped: a nested user namespace where we are 65534 and hold no caps
            # The init made itself non-dumpable (its /proc files owned by root, so the program cannot reach
            # it) and this fork inherited that: the new namespace's /proc/self/{setgroups,uid_map,gid_map}
            # would be root's too, and unwritable by a non-root user. The child execs the program right after
            # (execve makes it dumpable anyway), so it may be dumpable for these writes; the init stays not.
            check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE) for the program")
            check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER) for the program")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} 0 1"), ("gid_map", f"{NOBODY} 0 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        lim = cfg["limits"]
        limits = [("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["as_bytes"]), ("RLIMIT_FSIZE", lim["fsize_bytes"]),
                  ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)]
        if identity != "plain":  # RLIMIT_NPROC counts all processes of the uid: only ours in a namespace
            limits.append(("RLIMIT_NPROC", lim["nproc"]))
        for name, value in limits:
            hard = value + 1 if name == "RLIMIT_CPU" else value
            resource.setrlimit(getattr(resource, name), (value, hard))
        os.chdir(cfg["cwd"])
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:  # noqa: BLE001 - anything here is a setup failure of the sandbox
        os.write(2, f"sandbox: starting the program failed: {e}\n".encode())
    os._exit(SETUP_FAILED)


def kill_all_others() -> None:
    """As PID 1 of the namespace: SIGKILL every other process in it, then reap them all."""
    try:
        os.kill(-1, _signal.SIGKILL)
    except ProcessLookupError:  # nothing else is left
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


MEMORY_POLL_S = 0.02
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(group: int | None) -> int:
    """The resident memory of the call's processes: every process this PID namespace shows but the init
    (`group` None), or those of process group `group` (the unisolated mode, on the host's /proc)."""
    total, me = 0, os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if group is not None and os.getpgid(int(name)) != group:
                continue
            with open(f"/proc/{name}/statm", "rb") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return total


def relay(cfg: dict, pid: int, out_r: int, err_r: int, kill: Callable[[], None], group: int | None = None) -> dict:
    """Forward the program's output (capped per stream) until it exits or a limit trips (the wall clock, the
    output cap, the resident total of the call's processes: `resident_bytes(group)`)."""
    cap, deadline = cfg["max_output_bytes"], time.monotonic() + cfg["timeout_s"]
    total_cap = cfg["limits"].get("total_bytes", 0)
    sent = {out_r: 0, err_r: 0}
    dest = {out_r: 1, err_r: 2}

    def forward(fd: int, chunk: bytes) -> bool:
        """Pass on what fits under the stream's cap; True once the stream went over it."""
        room = cap - sent[fd]
        if room > 0:
            os.write(dest[fd], chunk[:room])
        sent[fd] += len(chunk)
        return sent[fd] > cap

    exited = os.pidfd_open(pid)
    open_fds = [out_r, err_r, exited]
    status, reason = None, None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        ready, _, _ = select.select(open_fds, [], [], min(left, MEMORY_POLL_S) if total_cap else left)
        if total_cap and resident_bytes(group) > total_cap:
            reason = "memory"
            break
        for fd in ready:
            if fd == exited:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            if forward(fd, chunk):
                reason = "output"
        if reason:
            break
        if exited in ready:
            status = os.waitpid(pid, 0)[1]
    kill()  # isolated: the program, its children, daemons: all gone before the files are copied
    if status is None:
        status = 9  # killed by us: report as SIGKILL
    for fd in (out_r, err_r):  # what was written before the kill, up to the cap
        while reason != "output" and (chunk := os.read(fd, 65536)):
            if forward(fd, chunk):
                reason = "output"
    return {"returncode": os.waitstatus_to_exitcode(status), "killed": reason}


def init(cfg: dict, nobody_mapped: bool) -> None:
    episode = os.open(cfg["episode_dir"], os.O_RDONLY | os.O_DIRECTORY)
    uid = NOBODY if nobody_mapped else 0
    root = cfg["episode_dir"] + "/root"
    build_view(root, cfg, uid)
    files = os.open("files", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=episode)
    work = os.open(root + WORK, os.O_RDONLY | os.O_DIRECTORY)
    try:
        copy_tree(files, work, uid, [cfg["scratch_inodes"], cfg["scratch_mb"] << 20])
    except OSError as e:
        raise SetupError(f"copying the episode's files in failed: {e}") from e
    os.close(files)
    pivot(root)
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    libc.sethostname(b"sandbox", 7)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(episode)
        os.close(work)
        drop_and_exec(cfg, "nobody" if nobody_mapped else "nested", out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    result = relay(cfg, pid, out_r, err_r, kill_all_others)
    os.mkdir("out", 0o700, dir_fd=episode)
    out = os.open("out", os.O_RDONLY | os.O_DIRECTORY, dir_fd=episode)
    copy_tree(work, out, None, [cfg["scratch_inodes"], cfg["scratch_mb"] << 20])
    fd = os.open("status", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=episode)
    os.write(fd, marshal.dumps(result))
    os.close(fd)


def run_plain(cfg: dict) -> None:
    """Unisolated mode (only when the config allows it): the same limits and relay, no namespaces;
    the program's process group is killed at the end, but a child that leaves it survives."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        drop_and_exec(cfg, "plain", out_w, err_w)
    os.close(out_w)
    os.close(err_w)

    def kill() -> None:
        try:
            os.killpg(pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass

    result = relay(cfg, pid, out_r, err_r, kill, group=pid)
    episode = os.open(cfg["episode_dir"], os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open("status", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=episode)
    os.write(fd, marshal.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    launcher(marshal.loads(bytes.fromhex(sys.argv[1])))
