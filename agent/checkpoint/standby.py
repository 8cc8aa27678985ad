"""A stopped copy of an engine restored beside the live one, and how it is continued."""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
from pathlib import Path

from agent.checkpoint.criu import restore_flags
from agent.checkpoint.cuda import gpu_pairs
from agent.checkpoint.snapshotter import Snapshotter
from agent.checkpoint.xcomp import continue_tree, process_tree, regrant_tree
from agent.errors import SnapshotError
from agent.store import Manifest

# What the standby's init reports when CRIU is done (one JSON line on its report pipe).
REPORT_LIMIT = 1 << 16


def init_argv(snap: Snapshotter, manifest: Manifest, socket: Path, report_fd: int) -> list[str]:
    """The command that restores `manifest` stopped, in new namespaces (agent.checkpoint.nsinit):
    the paths its sockets bind and its shared memory files are private to the copy there."""
    # Made (and pruned) here: the init sees the directories that exist when it starts.
    log = snap.restore_log(f"{manifest.id}-standby-{int(time.time() * 1000)}.log")
    argv = [sys.executable, "-m", "agent.checkpoint.nsinit", "--criu", str(snap.criu.binary.path),
            "--image", str(snap.store.path(manifest.id)), "--log", str(log),
            "--verbosity", str(snap.criu.restore_verbosity),
            "--report-fd", str(report_fd)]
    for path in sorted({str(socket), *manifest.process.socket_paths}):
        argv += ["--socket", path]
    for f in restore_flags(manifest.criu_flags):
        argv += [f"--flag={f}"]
    for pipe in sorted(set(manifest.process.inherited_pipes.values())):
        argv += ["--pipe", pipe]
    # Put back by the init into its private shm dir, from the image.
    argv += ["--shm-dir", str(snap.shm_dir)]
    for name in manifest.process.shm_files:
        argv += ["--shm", name]
    return argv


def read_report(fd: int, timeout_s: float) -> int:
    """The restored root's PID in its namespace, once the init reports; blocking. `fd` stays
    open, unread past that line: the init tells on it later how the root ended (a second
    line, agent/supervisor/paths/standby.py reads it)."""
    data = b""
    end = time.monotonic() + timeout_s
    while not data.endswith(b"\n") and len(data) < REPORT_LIMIT:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SnapshotError(f"the standby's restore did not finish in {timeout_s:g} s")
        # A byte at a time: the next line is not ours to read.
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    try:
        msg = json.loads(data or b"{}")
    except ValueError as e:
        raise SnapshotError(f"the standby's init reported {data[:200]!r}") from e
    if "pid" not in msg:
        raise SnapshotError(f"the standby's restore failed: {msg.get('error', 'no report')}")
    return int(msg["pid"])


def ns_root(init_pid: int, proc_root: Path = Path("/proc")) -> int:
    """The host PID of the restored root: the one child of the namespace's init (the one
    child of `init_pid`, the process that made the namespace)."""
    tree = process_tree(init_pid, proc_root)
    # init_pid (in the host's namespace) -> PID 1 of the new one -> the restored root.
    if len(tree) < 3:
        raise SnapshotError(f"the standby's tree under PID {init_pid} is gone")
    return tree[2]


def ns_pids(pids: list[int], proc_root: Path = Path("/proc")) -> dict[int, int]:
    """{PID in the standby's namespace: PID on the host} for `pids` (host PIDs)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in (proc_root / str(pid) / "status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    out[int(line.split()[-1])] = pid
    return out


def _cuda_pids(manifest: Manifest, pids: list[int], proc_root: Path) -> tuple[int, ...]:
    """The host PIDs of the image's CUDA processes (the image's PIDs are the namespace's)."""
    hosts = ns_pids(pids, proc_root)
    missing = [p for p in manifest.process.cuda_pids if p not in hosts]
    if missing:
        raise SnapshotError(f"standby: CUDA processes {missing} of snapshot {manifest.id} "
                            "are not in its restored tree")
    return tuple(hosts[p] for p in manifest.process.cuda_pids)


def _continue(snap: Snapshotter, root: int, proc_root: Path) -> tuple[list[int], float]:
    """The stopped tree under `root` (a host PID) let run: the AMX permission asked for
    again where the CPU has it, then SIGCONT. Its PIDs, and the seconds it took."""
    t0 = time.monotonic()
    pids = process_tree(root, proc_root)
    if snap.regrant.active(proc_root):
        regrant_tree(pids, proc_root)
    continue_tree(pids)
    return pids, time.monotonic() - t0


def wake_standby(snap: Snapshotter, manifest: Manifest, root: int, *, gpu_uuid: str | None,
                 proc_root: Path = Path("/proc")) -> dict[str, float]:
    """Let the stopped tree under `root` run, then each CUDA process's state restored onto
    the GPU and left locked (its CUDA calls wait for the unlock). Blocking; the stage
    timings."""
    pids, secs = _continue(snap, root, proc_root)
    timings = {"standby_continue": secs}
    if manifest.process.cuda_pids:
        snap.restore_cuda_locked(_cuda_pids(manifest, pids, proc_root), timings,
                                 gpu_pairs(manifest.identity.gpu_uuid, gpu_uuid))
    return timings


def continue_standby(snap: Snapshotter, manifest: Manifest, root: int, *,
                     gpu_uuid: str | None, woken: bool = False,
                     proc_root: Path = Path("/proc")) -> dict[str, float]:
    """Let the standby under `root` serve: let run now unless it was woken (`woken`), then
    each CUDA process restored (unless it was) and unlocked. Blocking; the stage timings."""
    if woken:
        pids, timings = process_tree(root, proc_root), {}
    else:
        pids, secs = _continue(snap, root, proc_root)
        timings = {"standby_continue": secs}
    if manifest.process.cuda_pids:
        snap.resume_cuda(_cuda_pids(manifest, pids, proc_root), timings,
                         gpu_pairs(manifest.identity.gpu_uuid, gpu_uuid))
    return timings
