"""The standby's init: a hybrid image restored, stopped, in fresh PID and mount namespaces."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import stat
import sys
from pathlib import Path

from agent.checkpoint.criu import CriuBackend
from agent.checkpoint.criu_locate import CriuBinary
from agent.errors import SnapshotError

# Run as `python -m agent.checkpoint.nsinit` (agent/checkpoint/standby.py builds the argv),
# never inside the agent. The live engine owns the image's PIDs and its socket's path, so
# the copy is restored where neither clashes: a new PID namespace (CRIU gives each process
# its dumped PID there) and a new mount namespace whose socket directory is a private
# tmpfs (the restored listening socket binds there, not over the live one's file).
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_BIND = 0x1000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None,
                       flags, data.encode() or None), f"mount {src} on {target}")


def hide_sockets(sockets: list[Path]) -> None:
    """A private tmpfs over each directory the tree binds a socket in, everything else in
    it bound back (the holder's socket, which the engine's resume connects to, may live
    beside the engine's)."""
    by_dir: dict[Path, set[str]] = {}
    for sock in sockets:
        by_dir.setdefault(sock.parent, set()).add(sock.name)
    for d in sorted(by_dir, key=lambda p: len(p.parts)):
        _hide(d, by_dir[d])


def _hide(d: Path, names: set[str]) -> None:
    old = os.open(d, os.O_PATH | os.O_DIRECTORY)
    entries = [e for e in os.listdir(f"/proc/self/fd/{old}") if e not in names]
    _mount("tmpfs", str(d), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
    for name in entries:
        src = f"/proc/self/fd/{old}/{name}"
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(src).st_mode):
                os.mkdir(d / name)
            else:
                (d / name).touch()
            _mount(src, str(d / name), None, MS_BIND | MS_REC)
    os.close(old)


def _restore(args: argparse.Namespace) -> int:
    """CRIU restores the image as our child, stopped; its PID in this namespace."""
    criu = CriuBackend(CriuBinary(Path(args.criu), "", "standby"))
    # CRIU wires each dumped pipe to an fd of ours: all go to our stdout (the agent's log).
    inherit = {os.dup(1): pipe for pipe in args.pipe}
    r = criu.restore(Path(args.image), Path(args.log), flags=tuple(args.flag),
                     inherit_fds=inherit, leave_stopped=True)
    for fd in inherit:
        os.close(fd)
    return r.pid


def _init(args: argparse.Namespace, report: int) -> None:
    """PID 1 of the new namespace: restore, report, then reap until the engine's root
    exits, and exit as it did (the namespace and whatever is left in it die with us)."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    root = 0
    try:
        hide_sockets([Path(p) for p in args.socket])
        root = _restore(args)
        msg = {"pid": root}
    except (OSError, SnapshotError) as e:
        msg = {"error": str(e)}
    os.write(report, (json.dumps(msg) + "\n").encode())
    os.close(report)
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
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m agent.checkpoint.nsinit")
    p.add_argument("--criu", required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--socket", action="append", default=[],
                   help="a path the tree binds a Unix socket at (repeated)")
    p.add_argument("--report-fd", type=int, required=True)
    p.add_argument("--flag", action="append", default=[])
    p.add_argument("--pipe", action="append", default=[], help="pipe:[INODE] of its stdout")
    args = p.parse_args(argv)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare(CLONE_NEWNS|CLONE_NEWPID)")
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
            code = os.waitstatus_to_exitcode(status)
            sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
