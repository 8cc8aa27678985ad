"""CRIU's lazy restore: `criu lazy-pages` serves a restored tree's memory by userfaultfd, so
the tree runs before its image is read; what it has not touched follows in the background.

CRIU hands over lazily only private anonymous memory that is not locked (the heap, Python's
and torch's arenas: most of an engine's image); the rest is written before the tree runs
(`vma_entry_can_be_lazy`, criu/include/vma.h). The daemon must outlive the transfer: a
region whose userfaultfd closes before its pages came reads as zeros from then on, so a
daemon that fails takes the tree it served down with it (`PageServer.watch`).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.checkpoint.criu_locate import CriuBinary
from agent.commands import Helper, start
from agent.errors import CommandError, SnapshotError
from agent.proc import disown

# CRIU's name for the daemon's socket, in the work directory both ends are given (-W).
SOCKET_NAME = "lazy-pages.socket"
# The daemon's start: CRIU reads its kernel facts (cached in /run/criu.kdat) and binds.
READY_TIMEOUT_S = 10.0
READY_POLL_S = 0.002
# The userfaultfd feature CRIU needs to serve a tree it did not fork (`criu check --feature`).
FEATURE = "uffd-noncoop"


@dataclass
class PageServer:
    """One `criu lazy-pages` daemon, serving the images of one restore.

    Example::

        pages = PageServer.start(criu.binary, image_dir, work_dir, log_dir / "lazy.log")
        criu.restore(image_dir, log, lazy_work_dir=pages.work_dir)
        pages.watch(on_failure=lambda why: kill_tree(pid))
    """

    process: Helper
    work_dir: Path
    log_path: Path
    started: float
    # Set once the daemon exited: its status and when (monotonic).
    returncode: int | None = None
    ended: float | None = None
    _done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, criu: CriuBinary, image_dir: Path, work_dir: Path, log_path: Path, *,
              verbosity: int = 4, ready_timeout_s: float = READY_TIMEOUT_S) -> PageServer:
        """The daemon, listening: a restore given `work_dir` connects to it. SnapshotError
        (the host's, not the image's) when it exits or does not listen in time."""
        work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        sock = work_dir / SOCKET_NAME
        sock.unlink(missing_ok=True)
        argv = [str(criu.path), "lazy-pages", "-D", str(image_dir), "-W", str(work_dir),
                f"-v{verbosity}", "-o", str(log_path)]
        t0 = time.monotonic()
        try:
            p = start(argv)
        except CommandError as e:
            raise SnapshotError(f"cannot start CRIU's lazy-pages daemon: {e}") from e
        deadline = t0 + ready_timeout_s
        while not sock.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with status {p.returncode}" if p.returncode is not None
                       else f"did not listen within {ready_timeout_s:g} s")
                _end(p)
                shutil.rmtree(work_dir, ignore_errors=True)
                raise SnapshotError(f"CRIU's lazy-pages daemon {why} (log: {log_path})")
            time.sleep(READY_POLL_S)
        return cls(p, work_dir, log_path, t0)

    def stop(self) -> None:
        """Kill the daemon (its restore failed: the tree it would serve is gone)."""
        if self.returncode is None and not self._done.is_set():
            _end(self.process)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def watch(self, on_failure: Callable[[str], None],
              on_done: Callable[[float], None] | None = None) -> None:
        """In a thread of its own: wait for the daemon; `on_done(seconds since its start)`
        when every page was handed over (status 0), `on_failure(why)` otherwise."""
        threading.Thread(target=self._wait, args=(on_failure, on_done),
                         name=f"pitstop-lazy-pages-{self.process.pid}", daemon=True).start()

    def wait(self, timeout_s: float) -> bool:
        """True once the watched daemon has exited (every page in place, or it failed)."""
        return self._done.wait(timeout_s)

    def _wait(self, on_failure: Callable[[str], None],
              on_done: Callable[[float], None] | None) -> None:
        try:
            rc = self.process.wait()
        finally:
            disown(self.process.pid)
            shutil.rmtree(self.work_dir, ignore_errors=True)  # its socket
        self.returncode, self.ended = rc, time.monotonic()
        try:
            if rc == 0:
                if on_done is not None:
                    on_done(self.ended - self.started)
            else:
                how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
                on_failure(f"CRIU's lazy-pages daemon {how} before every page was in place "
                           f"(log: {self.log_path})")
        finally:
            self._done.set()


def _end(p: Helper) -> None:
    p.kill()
    try:
        p.wait(10)
    finally:
        disown(p.pid)
