"""The standby's init: a hybrid image restored, stopped, in fresh PID, mount and net namespaces."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import sys
from pathlib import Path

from agent.checkpoint import outside
from agent.checkpoint.criu import RESTORE_VERBOSITY, CriuBackend
from agent.checkpoint.criu_locate import CriuBinary
from agent.errors import SnapshotError

# Run as `python -m agent.checkpoint.nsinit` (agent/checkpoint/standby.py builds the argv),
# never inside the agent. The live engine owns the image's PIDs and its socket's path, so
# the copy is restored where neither clashes: a new PID namespace (CRIU gives each process
# its dumped PID there) and a new mount namespace whose socket directory is a private
# tmpfs (the restored listening socket binds there, not over the live one's file). vLLM's
# tree also keeps shared memory files in /dev/shm, which the live engine goes on writing
# (a private /dev/shm holds the image's copies), and listens on and connects to loopback
# TCP ports the live engine holds (a new network namespace has its own loopback).
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_BIND = 0x1000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PR_SET_PDEATHSIG = 1
# <linux/sockios.h>, <net/if.h>: struct ifreq is the name (16 bytes) then a short of flags.
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = struct.Struct("16sh14x")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None,
                       flags, data.encode() or None), f"mount {src} on {target}")


def hide(paths: list[Path]) -> None:
    """A private tmpfs over each directory of `paths` (where the tree binds a socket, or
    keeps a shared memory file), everything else in it bound back (the holder's socket,
    which the engine's resume connects to, may live beside the engine's)."""
    by_dir: dict[Path, set[str]] = {}
    for path in paths:
        by_dir.setdefault(path.parent, set()).add(path.name)
    for d in sorted(by_dir, key=lambda p: len(p.parts)):
        _hide(d, by_dir[d])


def _hide(d: Path, names: set[str]) -> None:
    old = os.open(d, os.O_PATH | os.O_DIRECTORY)
    entries = [e for e in os.listdir(f"/proc/self/fd/{old}") if e not in names]
    st = os.fstat(old)
    # Owned and open as the directory it covers (/dev/shm and /tmp are 1777).
    _mount("tmpfs", str(d), "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode={stat.S_IMODE(st.st_mode):o},uid={st.st_uid},gid={st.st_gid}")
    for name in entries:
        src = f"/proc/self/fd/{old}/{name}"
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(src).st_mode):
                os.mkdir(d / name)
            else:
                (d / name).touch()
            _mount(src, str(d / name), None, MS_BIND | MS_REC)
    os.close(old)


def loopback_up() -> None:
    """`lo` up in this (new) network namespace: the tree's 127.0.0.1 sockets bind there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name, flags = IFREQ.unpack(fcntl.ioctl(s, SIOCGIFFLAGS, IFREQ.pack(b"lo", 0)))
        fcntl.ioctl(s, SIOCSIFFLAGS, IFREQ.pack(name, flags | IFF_UP))


def _prepare(args: argparse.Namespace) -> None:
    """The namespaces made ready for the image: loopback up, socket and shm directories
    private, the image's shm files (and CRIU's link_remap files) put back in the private one."""
    loopback_up()
    shm_dir = Path(args.shm_dir)
    hide([Path(p) for p in args.socket] + [shm_dir / n for n in args.shm])
    # Only this namespace sees them (and CRIU consumes the link_remap ones): nothing to
    # lock against the host's other restores, nothing to remove if CRIU fails.
    outside.put_back(Path(args.image), tuple(args.shm), (), shm_dir)


def _exit_report(status: int) -> dict[str, int]:
    """How the engine's root ended, for the agent: {"exit_code": N} or {"exit_signal": N}."""
    if os.WIFSIGNALED(status):
        return {"exit_signal": os.WTERMSIG(status)}
    return {"exit_code": os.WEXITSTATUS(status)}


def _exit_code(status: int) -> int:
    """A child's wait status as our own exit status: its code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _restore(args: argparse.Namespace) -> int:
    """CRIU restores the image as our child, stopped; its PID in this namespace."""
    criu = CriuBackend(CriuBinary(Path(args.criu), "", "standby"),
                       restore_verbosity=args.verbosity)
    # CRIU wires each dumped pipe to an fd of ours: all go to our stdout (the agent's log).
    inherit = {os.dup(1): pipe for pipe in args.pipe}
    r = criu.restore(Path(args.image), Path(args.log), flags=tuple(args.flag),
                     inherit_fds=inherit, leave_stopped=True)
    for fd in inherit:
        os.close(fd)
    return r.pid


def _init(args: argparse.Namespace, report: int) -> None:
    """PID 1 of the new namespace: restore, report, then reap until the engine's root
    exits, report how, and exit as it did (the namespace and whatever is left in it die with
    us; the agent, told at once, need not wait for that)."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    root = 0
    try:
        _prepare(args)
        root = _restore(args)
        msg = {"pid": root}
    except (OSError, SnapshotError) as e:
        msg = {"error": str(e)}
    os.write(report, (json.dumps(msg) + "\n").encode())
    if not root:
        os._exit(1)
    # A stop asked of us is the engine's to act on (SIGTERM drains it).
    signal.signal(signal.SIGTERM, lambda s, f: os.kill(root, signal.SIGTERM))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == root:
            with contextlib.suppress(OSError):  # the agent may be gone: exit all the same
                os.write(report, (json.dumps(_exit_report(status)) + "\n").encode())
            os._exit(_exit_code(status))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m agent.checkpoint.nsinit")
    p.add_argument("--criu", required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--verbosity", type=int, default=RESTORE_VERBOSITY, help="CRIU's -v")
    p.add_argument("--socket", action="append", default=[],
                   help="a path the tree binds a Unix socket at (repeated)")
    p.add_argument("--shm", action="append", default=[],
                   help="a shared memory file the image saved (repeated)")
    p.add_argument("--shm-dir", default=str(outside.SHM_DIR))
    p.add_argument("--report-fd", type=int, required=True)
    p.add_argument("--flag", action="append", default=[])
    p.add_argument("--pipe", action="append", default=[], help="pipe:[INODE] of its stdout")
    args = p.parse_args(argv)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET),
           "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWNET)")
    # Nothing mounted here may reach the host's mount table.
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    child = os.fork()
    if child == 0:
        # PID 1 dies with us: a namespace whose init dies takes every process in it along.
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
        _init(args, args.report_fd)
    os.close(args.report_fd)
    signal.signal(signal.SIGTERM, lambda s, f: os.kill(child, signal.SIGTERM))
    while True:
        with contextlib.suppress(InterruptedError):
            _, status = os.waitpid(child, 0)
            sys.exit(_exit_code(status))


if __name__ == "__main__":
    main()
