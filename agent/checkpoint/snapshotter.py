"""Take a snapshot of a running engine tree into the store, and restore one."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agent.checkpoint import outside
from agent.checkpoint.backend import (
    BackendName,
    CreateRequest,
    Image,
    RestoredProcess,
    SnapshotInfo,
)
from agent.checkpoint.connections import refuse_outside_connections
from agent.checkpoint.criu import (
    CRIU_TIMEOUT_S,
    CriuBackend,
    DumpOptions,
    NetworkLock,
    RestoreResult,
    restore_flags,
)
from agent.checkpoint.cuda import CudaCheckpoint, GpuPair, gpu_pairs, uses_cuda
from agent.checkpoint.xcomp import Regrant, continue_tree, process_tree, regrant_tree
from agent.checkpoint.zeropages import ImageDamagedError, ImageFormatError, drop_zero_pages
from agent.config import Config
from agent.errors import RestoreBlockedError, SnapshotError
from agent.identity import REMAPPED_FIELDS
from agent.proc import descendants, ids_in_use, kill_tree, stat, wait_exits
from agent.store import (
    Manifest,
    ProcessTree,
    Skipped,
    SnapshotKind,
    SnapshotStore,
)
from agent.store.files import DIR_MODE

__all__ = ["RestoredProcess", "SnapshotInfo", "Snapshotter", "std_pipes", "tree_pids"]

logger = logging.getLogger("pitstop.snapshot")

LOG_DIR = ".logs"
# CRIU's logs (-v4: about 0.5 MB a dump) are kept for the last few operations only: a node
# that restores a thousand times must not fill its disk with them.
LOG_KEEP = 16
# Only the standard streams are re-wired on restore; the supervisor gives the engine
# stdin /dev/null and stdout/stderr pipes.
STD_FDS = (1, 2)
# How long a restore waits for the PIDs of its image to be free: the tree it replaces may
# still be exiting. A SIGKILLed vLLM engine core holding 32 GiB of weights took longer to go
# than the agent took to decide on a restore, and kept its session's ID (the image's root
# PID) taken: CRIU then failed with "Can't fork for PID: File exists".
PID_WAIT_S = 30.0
# How soon the PIDs are looked at again when each holder has exited already (a zombie): its
# reap, by its parent or by the agent as the subreaper, is due at once.
ZOMBIES_AGAIN_S = 0.005


def tree_pids(root: int, proc_root: Path = Path("/proc")) -> tuple[int, ...]:
    """`root` and all its live descendants."""
    return (root, *descendants(root, proc_root))


def std_pipes(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    """{"1": "pipe:[INODE]", ...} for the root's stdout/stderr that are pipes."""
    pipes = {}
    for fd in STD_FDS:
        with contextlib.suppress(OSError):
            target = os.readlink(proc_root / str(pid) / "fd" / str(fd))
            if target.startswith("pipe:["):
                pipes[str(fd)] = target
    return pipes


class Snapshotter:
    """Pitstop's checkpoint backend (CRIU of the tree, CUDA checkpoint of each process that
    holds a GPU), and the store it captures into: the `full` and `hybrid` rungs' engine.

    Example::

        snap = Snapshotter(store, CriuBackend(locate()), CudaCheckpoint())
        info = take(store, snap, CreateRequest("full", pid=engine_pid, canary=canary),
                    host_identity)
        ...
        restored = snap.restore(store.select(host_identity).chosen)
        restored.pid  # same PID as at dump time; verify the canary, then report ready
    """

    def __init__(
        self,
        store: SnapshotStore,
        criu: CriuBackend,
        cuda: CudaCheckpoint | None = None,
        *,
        log_dir: Path | None = None,
        restore_log_dir: Path | None = None,
        proc_root: Path = Path("/proc"),
        shm_dir: Path = outside.SHM_DIR,
        clock: Callable[[], float] = time.monotonic,
        regrant: Regrant = Regrant.AUTO,
        pid_wait_s: float = PID_WAIT_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.name = BackendName.CRIU
        self.kinds: frozenset[SnapshotKind] = frozenset({"full", "hybrid"})
        # CRIU restores the tree from anywhere: images are made in a draft and renamed.
        self.in_place = False
        # A snapshot taken on another GPU of the same kind comes back on this host's GPU.
        self.remaps: frozenset[str] = REMAPPED_FIELDS
        self.store = store
        self.criu = criu
        self.cuda = cuda
        self.log_dir = log_dir or store.root / LOG_DIR
        # A restore writes its log and pidfile here, not beside the images: with the store's
        # file system full, a restore must still work (it only reads the image).
        self.restore_log_dir = restore_log_dir or self.log_dir
        self._proc = proc_root
        self._shm = shm_dir
        self._clock = clock
        self.regrant = regrant
        self.pid_wait_s = pid_wait_s
        self._sleep = sleep

    def reconfigure(self, config: Config) -> None:
        """snapshots.cuda_lock_timeout_ms and restore_log_level, as a reload left them: the
        next checkpoint's lock, the next restore's CRIU log."""
        self.criu.restore_verbosity = config.snapshots.restore_log_level
        if self.cuda is not None:
            self.cuda.lock_timeout_ms = config.snapshots.cuda_lock_timeout_ms

    @property
    def shm_dir(self) -> Path:
        """Where the trees it dumps keep their shared memory files (/dev/shm)."""
        return self._shm

    @property
    def create_limit_s(self) -> float:
        # CRIU's own limit, and as long again for what has none around it: the CUDA
        # checkpoint and restore of each process, the zero-page rewrite, the seal's hashing.
        return 2 * CRIU_TIMEOUT_S

    @property
    def restore_limit_s(self) -> float:
        # The wait for the image's PIDs, then CRIU and the CUDA restore, likewise.
        return self.pid_wait_s + 2 * CRIU_TIMEOUT_S

    def _log(self, name: str, where: Path | None = None) -> Path:
        d = where or self.log_dir
        d.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _prune_logs(d, LOG_KEEP - 1)
        return d / name

    def create(self, request: CreateRequest, staging: Path) -> Image:
        """Dump the tree rooted at `request.pid` into `staging`. The engine must be idle (no
        requests in flight) and its stdin /dev/null. Without `leave_running` CRIU kills the
        tree after a successful dump. A failed dump leaves the engine running (CUDA
        restored and unlocked).

        A connection from outside the tree still open raises OpenConnectionsError before
        anything runs (TCP included: the engine is left running and goes on talking to
        that peer, so no restore could match the peer's view of it). The TCP connections
        left have both ends in the tree: they are dumped with `--tcp-established` and no
        network lock, as both ends freeze and come back together."""
        if request.pid is None or request.canary is None:
            raise ValueError("a CRIU snapshot is of a running engine: give its pid and canary")
        pid = request.pid
        opts = request.dump_options or DumpOptions(leave_running=request.leave_running)
        timings: dict[str, float] = {}
        pids = tree_pids(pid, self._proc)
        tcp = refuse_outside_connections(pids, self._proc).tcp
        used = outside.survey(pids, self._proc, self._shm)
        pipes = std_pipes(pid, self._proc)
        name = staging.name.removeprefix(".tmp-")
        with outside.remap_window(self._shm):
            stale = outside.drop_stale_remaps(pids, self._shm, self._proc)
            if stale:
                logger.warning("removed CRIU link remaps no process holds (left by a CRIU "
                               "that died mid-dump): %s", ", ".join(stale))
            log = self._log(f"{name}-dump.log")
            script = self._log(f"{name}-post-dump.sh")
            outside.post_dump_script(script, used, staging, self._shm)
            opts = replace(opts, tcp_established=opts.tcp_established or tcp.internal_present,
                           network_lock=NetworkLock.SKIP, action_script=script)
            cuda_pids = tuple(p for p in pids if uses_cuda(p, self._proc))
            self._suspend(cuda_pids, timings)
            try:
                dumped = self.criu.dump(pid, staging, log, opts)
            except SnapshotError as e:
                self._resume(cuda_pids, timings, cause=e)
                raise
            finally:
                script.unlink(missing_ok=True)
            timings["criu_dump"] = dumped.duration_s
            tree = ProcessTree(
                root_pid=pid,
                pids=pids,
                inherited_pipes=pipes,
                cuda_pids=cuda_pids,
                shm_files=outside.saved(staging),
                socket_paths=used.socket_paths,
            )
        if opts.leave_running:
            self._resume(tree.cuda_pids, timings)
        if request.kind == "hybrid":
            self._drop_zero_pages(staging, timings)
        return Image(process=tree, canary=request.canary, timings=timings,
                     criu_flags=dumped.flags, held=request.held)

    def _drop_zero_pages(self, staging: Path, timings: dict[str, float]) -> None:
        # A hybrid image is restored on the path that must take well under a second, and
        # it is small (the engine's own memory): rewriting it costs about a second at the
        # dump, once. A full image is mostly weights, which are not zeros.
        t0 = self._clock()
        try:
            d = drop_zero_pages(staging)
        except ImageFormatError as e:
            logger.warning("zero pages kept in the image (it stays as CRIU wrote it): %s", e)
            return
        except ImageDamagedError as e:
            raise SnapshotError(f"the dump's image is damaged, not published: {e}") from e
        except OSError as e:
            raise SnapshotError(f"dropping zero pages from {staging}: {e}") from e
        timings["zero_pages"] = self._clock() - t0
        logger.info("left %d all-zero pages (%.0f MB) of %d out of the image in %.2fs",
                    d.dropped, d.bytes / 1e6, d.pages, timings["zero_pages"])

    def inspect(self, manifest: Manifest, image: Path) -> Skipped | None:
        """Nothing to add: the store's checksums and identity are all CRIU's image needs."""
        return None

    def _cuda(self) -> CudaCheckpoint:
        if self.cuda is None:
            raise SnapshotError("the engine uses CUDA but no CUDA checkpoint backend was given")
        return self.cuda

    def _suspend(self, pids: tuple[int, ...], timings: dict[str, float]) -> None:
        """CUDA lock + checkpoint of each PID; if one fails, the ones done are resumed."""
        done: list[int] = []
        for p in pids:
            try:
                t = self._cuda().suspend(p)
            except SnapshotError as e:
                self._resume(tuple(done), timings, cause=e)
                raise
            done.append(p)
            timings["cuda_lock"] = timings.get("cuda_lock", 0.0) + t.first_s
            timings["cuda_checkpoint"] = timings.get("cuda_checkpoint", 0.0) + t.second_s

    def _resume(
        self, pids: tuple[int, ...], timings: dict[str, float], cause: Exception | None = None,
        pairs: tuple[GpuPair, ...] = (),
    ) -> None:
        """CUDA restore + unlock of every PID at once (onto other GPUs per `pairs`). After a
        failure (`cause`), a failing resume is reported together with the cause: that engine
        can no longer serve."""
        if not pids:
            return
        t0 = self._clock()
        try:
            each = self._cuda().resume_all(pids, pairs)
        except SnapshotError as e:
            if cause is None:
                raise
            raise SnapshotError(
                f"{cause}\nand then the CUDA restore/unlock failed too: {e}; "
                f"the engine cannot serve: kill it and cold start"
            ) from e
        wall = self._clock() - t0
        restore = max(t.first_s for t in each.values())
        timings["cuda_restore"] = timings.get("cuda_restore", 0.0) + restore
        timings["cuda_unlock"] = timings.get("cuda_unlock", 0.0) + max(0.0, wall - restore)
        _log_each("restore + unlock", {p: t.first_s + t.second_s for p, t in each.items()}, wall)

    def restore_log(self, name: str) -> Path:
        """A restore's log path, its directory made (a standby's restore)."""
        return self._log(name, self.restore_log_dir)

    def resume_cuda(self, pids: tuple[int, ...], timings: dict[str, float],
                    pairs: tuple[GpuPair, ...] = ()) -> None:
        """CUDA restore + unlock of every PID of a tree restored elsewhere (a standby)."""
        self._resume(pids, timings, pairs=pairs)

    def restore_cuda_locked(self, pids: tuple[int, ...], timings: dict[str, float],
                            pairs: tuple[GpuPair, ...] = ()) -> None:
        """CUDA restore of every PID at once, left locked (a standby woken ahead of the
        crash: its resume_cuda later only unlocks)."""
        if not pids:
            return
        t0 = self._clock()
        each = self._cuda().restore_all(pids, pairs)
        wall = self._clock() - t0
        timings["cuda_restore"] = timings.get("cuda_restore", 0.0) + wall
        _log_each("restore", each, wall)

    def restore(self, manifest: Manifest, image: Path | None = None, *,
                gpu_uuid: str | None = None) -> RestoredProcess:
        """Restore a snapshot `select` chose (from `image`, by default its directory in the
        store), onto the GPU `gpu_uuid` when it was taken on another (the CUDA driver's GPU
        pairs; None: the GPU it was taken on). On any failure the restored tree is killed
        and SnapshotError raised: the caller quarantines it and falls to a cold start.
        RestoreBlockedError (a PID of the image still taken) is the host's failure, not the
        image's: nothing ran, and the snapshot stays good."""
        waited = self._wait_pids_free(manifest)
        image_dir = image or self.store.path(manifest.id)
        log = self._log(f"{manifest.id}-restore-{int(time.time() * 1000)}.log",
                        self.restore_log_dir)
        # One new pipe per old pipe inode; the write end goes to CRIU, we keep the read end.
        readers: dict[str, int] = {}
        writers: dict[int, str] = {}
        for what in sorted(set(manifest.process.inherited_pipes.values())):
            r, w = os.pipe()
            readers[what] = r
            writers[w] = what
        timings: dict[str, float] = {"pid_wait": waited}
        # CRIU does not restore the AMX permission: the tree stays stopped until each of
        # its processes has asked for it again (agent/checkpoint/xcomp.py).
        regrant = self.regrant.active(self._proc)
        try:
            done, copies = self._criu_restore(manifest, image_dir, log, writers, timings,
                                              leave_stopped=regrant)
        except BaseException:
            for fd in [*readers.values(), *writers]:
                os.close(fd)
            raise
        for fd in writers:
            os.close(fd)
        timings["criu_restore"] = done.duration_s
        files = {what: os.fdopen(fd, "rb", buffering=0) for what, fd in readers.items()}
        outputs = {int(n): files[w] for n, w in manifest.process.inherited_pipes.items()}
        restored = RestoredProcess(done.pid, manifest.id, outputs, log, timings)
        try:
            self._bring_up(restored, manifest, regrant=regrant, gpu_uuid=gpu_uuid)
        except BaseException:
            kill_tree(done.pid, proc=self._proc)
            for f in files.values():
                f.close()
            self._take_back(manifest, copies, locked=False)
            raise
        return restored

    def _take_back(self, manifest: Manifest, copies: dict[outside.FileId, str], *,
                   locked: bool) -> None:
        """The image's shm copies out of the shm dir again after a failed restore (under
        `remap_window`, which the caller holds when `locked`): each is RAM, and once this
        restore failed nothing would remove it. Never raises over the restore's error."""
        try:
            with contextlib.nullcontext() if locked else outside.remap_window(self._shm):
                gone = outside.take_back(copies, self._shm)
        except (OSError, SnapshotError) as e:
            logger.warning("snapshot %s: could not remove the copies of its shared-memory "
                           "files from %s after the failed restore: %s", manifest.id,
                           self._shm, e)
            return
        if gone.names:
            logger.info("snapshot %s: removed %d copies of its shared-memory files (%d "
                        "bytes) from %s after the failed restore", manifest.id,
                        len(gone.names), gone.bytes, self._shm)

    def _criu_restore(self, manifest: Manifest, image_dir: Path, log: Path,
                      writers: dict[int, str], timings: dict[str, float], *,
                      leave_stopped: bool,
                      ) -> tuple[RestoreResult, dict[outside.FileId, str]]:
        """`criu restore`, the files the tree keeps outside itself put back first under the
        host's remap lock (and taken away again when CRIU fails); with the copies put back."""
        with outside.remap_window(self._shm) as remap_wait:
            timings["remap_wait"] = remap_wait
            copies = outside.put_back(image_dir, manifest.process.shm_files,
                                      manifest.process.socket_paths, self._shm)
            try:
                done = self.criu.restore(
                    image_dir, log, flags=restore_flags(manifest.criu_flags),
                    inherit_fds=writers, leave_stopped=leave_stopped)
            except BaseException:
                self._take_back(manifest, copies, locked=True)
                raise
        return done, copies

    def _bring_up(self, restored: RestoredProcess, manifest: Manifest, *, regrant: bool,
                  gpu_uuid: str | None) -> None:
        """After CRIU: the root PID checked, the AMX permission granted again and the tree
        continued (`regrant`), then the CUDA state restored (onto `gpu_uuid`)."""
        timings = restored.timings
        if restored.pid != manifest.process.root_pid:
            raise SnapshotError(f"snapshot {manifest.id}: restored root PID {restored.pid}, "
                                f"dumped as {manifest.process.root_pid}")
        if regrant:
            t0 = self._clock()
            pids = process_tree(restored.pid, self._proc)
            restored.amx = regrant_tree(pids, self._proc)
            continue_tree(pids)
            timings["amx_regrant"] = self._clock() - t0
        # Continued first: the CUDA restore was only ever run, and measured, on a running
        # tree.
        pairs = gpu_pairs(manifest.identity.gpu_uuid, gpu_uuid)
        if pairs:
            logger.info("snapshot %s: restoring its CUDA state onto another GPU: %s",
                        manifest.id, ", ".join(map(str, pairs)))
        self._resume(manifest.process.cuda_pids, timings, pairs=pairs)


    def _wait_pids_free(self, manifest: Manifest) -> float:
        """Return (the seconds it waited) once no process, thread, process group or session
        holds a PID the image was dumped with; RestoreBlockedError after `pid_wait_s`."""
        t0 = self._clock()
        end = t0 + self.pid_wait_s
        first = ""  # who held them when first seen: gone by the time they are free
        while True:
            held = ids_in_use(manifest.process.pids, self._proc)
            if not held:
                if first:
                    logger.info("snapshot %s: waited %.2f s for its PIDs (%s)", manifest.id,
                                self._clock() - t0, first)
                return self._clock() - t0
            first = first or _holders(held, self._proc)
            if self._clock() >= end:
                break
            # Woken by the holders' exits (pidfds), not a polling tick; when each has exited
            # already, its reap (by its parent, or the agent as their subreaper) is due now.
            # (A pidfd names a process of this host's /proc only.)
            if self._proc != Path("/proc") or not wait_exits(set(held.values()),
                                                              end - self._clock()):
                self._sleep(ZOMBIES_AGAIN_S)
        pid, holder = min(held.items())
        try:
            comm = (self._proc / str(holder) / "comm").read_text().strip()
        except OSError:
            comm = "gone since"
        how = "as its PID" if holder == pid else "as a thread, process group or session ID"
        raise RestoreBlockedError(
            f"snapshot {manifest.id}: PID {pid}, which the restore must give back to its "
            f"process, is still taken after {self.pid_wait_s:g} s: process {holder} ({comm}) "
            f"holds it {how}; stop that process, or let it exit")


def _holders(held: dict[int, int], proc_root: Path) -> str:
    """"PID 12 by 34 (python3), ..." for a log line."""
    out = []
    for pid, holder in sorted(held.items()):
        try:
            comm = (proc_root / str(holder) / "comm").read_text().strip()
        except OSError:
            comm = "gone"
        st = stat(holder, proc_root)
        state = f", state {st.state}" if st else ""
        out.append(f"PID {pid} by {holder} ({comm}{state})")
    return ", ".join(out)


def _prune_logs(d: Path, keep: int) -> None:
    """Delete all but the newest `keep` logs in `d` (a pidfile goes with its log)."""
    logs = []
    for e in os.scandir(d):
        if e.name.endswith(".log") and e.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                logs.append((e.stat(follow_symlinks=False).st_mtime_ns, e.path))
    logs.sort()
    for _, path in logs[:max(0, len(logs) - keep)]:
        for p in (path, path + ".pid"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def _log_each(what: str, seconds: dict[int, float], wall: float) -> None:
    """One line of each process's CUDA share: the restores run side by side, so the stage's
    figure is the slowest of them, and which one that was is only said here."""
    if len(seconds) > 1:
        logger.info("CUDA %s of %d processes at once in %.3f s: %s", what, len(seconds), wall,
                    ", ".join(f"PID {p} {s:.3f} s" for p, s in sorted(seconds.items())))
