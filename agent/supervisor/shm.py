"""A dead engine tree's shared-memory files, removed once the next engine is ready."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from agent import proc
from agent.checkpoint import outside
from agent.checkpoint.outside import FileId
from agent.errors import SnapshotError
from agent.fsutil import write_private

log = logging.getLogger("pitstop.supervisor")

# Beside the engine record (ownership.RECORD_NAME) in the state directory.
RECORD_NAME = "engine-shm.json"

# The shared-memory files of the engine tree rooted at a PID, each with its name or ""
# (outside.shared_files).
Survey = Callable[[int], Mapping[FileId, str]]


# How long a failed engine's kill waits for the survey of its tree: reading the maps of a
# process stuck in the kernel (a hung driver call holding its memory map's lock) can block.
FAILED_SURVEY_S = 2.0


def tree_survey(shm_dir: Path = outside.SHM_DIR, proc_root: Path = Path("/proc")) -> Survey:
    """The survey of a live tree from /proc: its root and every descendant, and the other
    members of the root's process group and session (each engine leads its own): those of a
    tree whose root died first (vLLM's engine core after its API server)."""
    def survey(pid: int) -> dict[FileId, str]:
        return outside.shared_files(tuple(proc.tree_and_group(pid, proc_root)), proc_root,
                                    shm_dir)
    return survey


class ShmRecord(BaseModel):
    """The shared-memory files of the engine tree that served last, kept for the next agent:
    should this one die, its engine's tree dies with it (the tether) and nobody else knows
    what the tree left. Files are (device, inode, name) as `outside.shared_files` gives them;
    they mean nothing in another boot."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    boot_id: str
    pid: int
    files: tuple[tuple[int, int, str], ...]

    @classmethod
    def of(cls, pid: int, files: Mapping[FileId, str], boot_id: str) -> ShmRecord:
        return cls(boot_id=boot_id, pid=pid,
                   files=tuple(sorted((dev, ino, name) for (dev, ino), name in files.items())))

    def mapping(self) -> dict[FileId, str]:
        return {(dev, ino): name for dev, ino, name in self.files}


class ShmLeftovers:
    """Knows the shared-memory files of the engine tree that serves; once the next engine is
    ready, removes those of the tree before it that the new one does not use.

    vLLM's resource tracker unlinks its ring buffers (`psm_*`) and semaphores (`sem.*`) when
    vLLM stops, but it dies with a killed tree (a crash, a hang): each file then stays in
    /dev/shm, in RAM, with nobody to remove it. Every rung's engine becomes ready through
    `Supervisor._ready`, which calls `ready`; the surveys and the sweep run in worker
    threads, after the new engine serves, so a recovery never waits for them. A tree that
    started but failed its checks (health, canary, the rung's own) is surveyed by `failed`
    before its kill and swept with the next ready engine. A restore that fails after putting
    its image's copies back removes them itself (`Snapshotter.restore`).

    With a `record` file, the serving tree's files are also written there, and the first
    engine ready after the agent started sweeps what the record names: the files of the tree
    that died with the agent before it (killed by the tether, or by `kill_leftovers`, before
    this agent started anything).

    Example::

        shm = ShmLeftovers(record=state_dir / RECORD_NAME)
        shm.ready(engine.pid)   # after each engine is verified; the one before it is gone
    """

    def __init__(self, shm_dir: Path = outside.SHM_DIR, survey: Survey | None = None,
                 record: Path | None = None, proc_root: Path = Path("/proc")) -> None:
        self._shm = shm_dir
        self._survey = survey if survey is not None else tree_survey(shm_dir)
        self._record = record
        self._proc = proc_root
        # The tree serving now, and its files: None before the first engine is ready.
        self._serving: tuple[int, dict[FileId, str]] | None = None
        # Trees killed before they became ready, and their files: swept with the next ready.
        self._unready: list[tuple[int, dict[FileId, str]]] = []
        self._last: asyncio.Task[None] | None = None

    def ready(self, pid: int) -> None:
        """Engine `pid` serves: survey it, then sweep what the tree before it left."""
        self._last = asyncio.ensure_future(self._after_ready(pid, self._last))

    async def failed(self, pid: int) -> None:
        """Engine `pid` never became ready and is about to be killed: survey its tree while
        it lives (at most FAILED_SURVEY_S), so that the next ready engine sweeps its files
        too. A start loop that keeps failing would otherwise leave a tree's files at every
        try."""
        try:
            files = await asyncio.wait_for(asyncio.to_thread(self._survey, pid),
                                           FAILED_SURVEY_S)
        except (TimeoutError, OSError) as e:
            log.warning("could not list the shared-memory files of engine %d, which failed "
                        "before it was ready (%s): they stay in %s", pid,
                        e or "no answer from /proc", self._shm)
            return
        if files:
            self._unready.append((pid, dict(files)))

    async def settled(self) -> None:
        """Until the work of the last `ready` is done."""
        if self._last is not None:
            await asyncio.wait([self._last])

    async def _after_ready(self, pid: int, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            # In the order the engines became ready: the tree before is the one surveyed last.
            await asyncio.wait([before])
        live = dict(await asyncio.to_thread(self._survey, pid))
        dead = self._serving
        if dead is None and self._record is not None:
            dead = await asyncio.to_thread(self._predecessor)
        self._serving = (pid, live)
        if self._record is not None:
            await asyncio.to_thread(self._keep, pid, live)
        trees, self._unready = [*([dead] if dead else []), *self._unready], []
        for gone, files in trees:
            if files:
                await self._sweep(gone, files, live)

    async def _sweep(self, gone: int, files: dict[FileId, str],
                     live: dict[FileId, str]) -> None:
        try:
            swept = await asyncio.to_thread(outside.sweep, files, live, self._shm)
        except (OSError, SnapshotError) as e:
            log.warning("could not remove the shared-memory files engine %d left in %s: %s",
                        gone, self._shm, e)
            return
        log.info("removed %d shared-memory files (%d bytes) engine %d left in %s%s",
                 len(swept.names), swept.bytes, gone, self._shm,
                 f": {', '.join(swept.names)}" if swept.names else "")

    def _predecessor(self) -> tuple[int, dict[FileId, str]] | None:
        """The tree the record names, left by the agent before this one in this boot."""
        assert self._record is not None
        try:
            rec = ShmRecord.model_validate_json(self._record.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError) as e:
            log.warning("ignoring %s, which does not read as a record of shared-memory files: "
                        "%s", self._record, e)
            return None
        if rec.boot_id != proc.boot_id(self._proc):
            return None
        return rec.pid, rec.mapping()

    def _keep(self, pid: int, files: dict[FileId, str]) -> None:
        assert self._record is not None
        try:
            rec = ShmRecord.of(pid, files, proc.boot_id(self._proc))
            # Not fsynced: it means nothing after a reboot, when /dev/shm is empty anyway.
            write_private(self._record, rec.model_dump_json().encode(), durable=False)
        except OSError as e:
            log.warning("cannot record engine %d's shared-memory files in %s (%s): should "
                        "this agent die, they stay in %s", pid, self._record, e, self._shm)
