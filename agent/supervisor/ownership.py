"""One agent per state directory: its lock, and the engine a dead predecessor left running."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, ConfigDict, ValidationError

from agent import proc
from agent.errors import AgentRunningError
from agent.fsutil import write_private

log = logging.getLogger("pitstop.ownership")

LOCK_NAME = "agent.lock"
RECORD_NAME = "engine.json"
GONE_TIMEOUT_S = 10.0


class StateLock:
    """The exclusive lock on a state directory, held for the agent's whole life.

    It is an flock on an O_CLOEXEC descriptor: no engine or CRIU (forked, then exec'd)
    inherits it, so it goes exactly when the agent's process does, however that dies.

    Example::

        with StateLock.take(config.paths.state_dir):
            ...  # run the agent; a second one on this directory gets AgentRunningError
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, state_dir: Path) -> StateLock:
        path = state_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"PID {holder}" if holder.isdigit() else "PID unknown"
            kill = f"`kill {holder}`" if holder.isdigit() else "kill it"
            raise AgentRunningError(
                f"another agent ({who}) already runs on state directory {state_dir} (it holds "
                f"{path}); stop it first (`systemctl stop pitstop-agent`, or {kill} if it was "
                "started by hand), or give this agent its own paths.state_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StateLock:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class Tether:
    """The agent's end of `agent.tether`: the helper that kills the engine's process group
    the moment the agent dies (the pipe closes), not only at the next agent's start.

    Example::

        tether = Tether.start()
        tether.engine(EngineRecord(...))   # each engine that starts or is restored
        tether.no_engine()                 # after the agent stopped it itself
    """

    def __init__(self, pid: int, pipe: int) -> None:
        self.pid = pid
        self._pipe: int | None = pipe

    @classmethod
    def start(cls) -> Tether:
        read, write = os.pipe()  # both close-on-exec: no engine or CRIU holds the write end
        try:
            with proc.spawn_lock():
                p = subprocess.Popen(
                    [sys.executable, "-m", "agent.tether"], stdin=read,
                    stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        # It outlives this Popen; if it dies early the agent's reaper collects it.
        p.returncode = 0
        return cls(p.pid, write)

    def _send(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            os.write(self._pipe, line.encode())
        except OSError as e:
            log.warning("the tether (PID %d) is gone (%s): should this agent die, its engine's "
                        "process group is killed only when the next agent starts", self.pid, e)
            os.close(self._pipe)
            self._pipe = None

    def engine(self, rec: EngineRecord) -> None:
        self._send(f"{rec.pid} {rec.start_time} {rec.pgid} {rec.session}\n")

    def no_engine(self) -> None:
        self._send("\n")


class EngineRecord(BaseModel):
    """Which process tree is this state directory's engine, exactly enough to kill it later.

    A PID alone could be a stranger by then; with the start time and the boot it names one
    process. The engine leads its own session and group, which hold its whole tree even after
    its root died (vLLM's engine core outliving its API server).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    boot_id: str
    pid: int
    start_time: int
    pgid: int
    session: int


class EngineLedger:
    """Records the running engine in the state directory; finds and kills what a dead
    agent left.

    Example::

        ledger = EngineLedger(state_dir)
        ledger.kill_leftovers()          # at start, under the StateLock
        ledger.record(engine.pid)        # each time an engine starts or is restored
        ledger.clear()                   # after the engine was stopped
    """

    def __init__(self, state_dir: Path, proc_root: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic,
                 tether: Tether | None = None) -> None:
        self.path = state_dir / RECORD_NAME
        self._proc = proc_root
        self._clock = clock
        self._tether = tether

    def record(self, pid: int) -> None:
        st = proc.stat(pid, self._proc)
        if st is None:
            return  # gone already: nothing to leave behind
        try:
            rec = EngineRecord(boot_id=proc.boot_id(self._proc), pid=pid,
                               start_time=st.start_time, pgid=st.pgid, session=st.session)
            if self._tether is not None:
                self._tether.engine(rec)
            # Not fsynced: PIDs mean nothing after a reboot, and this runs on the event loop.
            write_private(self.path, rec.model_dump_json().encode(), durable=False)
        except OSError as e:
            log.warning("cannot record engine %d in %s: %s; should this agent die, kill the "
                        "engine's process group %d by hand", pid, self.path, e, st.pgid)

    def read(self) -> EngineRecord | None:
        try:
            return EngineRecord.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError) as e:
            log.warning("ignoring %s, which does not read as an engine record: %s", self.path, e)
            return None

    def clear(self) -> None:
        if self._tether is not None:
            self._tether.no_engine()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def leftovers(self) -> list[int]:
        """The live processes of the recorded engine's tree and group, root first."""
        rec = self.read()
        if rec is None or rec.boot_id != proc.boot_id(self._proc):
            return []
        return proc.engine_remains(rec.pid, rec.start_time, rec.pgid, rec.session, self._proc)

    def kill_leftovers(self, timeout_s: float = GONE_TIMEOUT_S) -> list[int]:
        """SIGKILL what a dead predecessor's engine left, then wait until each of those
        processes and the recorded root are reaped: only then is their memory (a GPU's
        included) free, and their PIDs, which a restore of the same engine needs again.
        Blocking: call it before the event loop starts. Returns the PIDs killed."""
        rec = self.read()
        if rec is None or rec.boot_id != proc.boot_id(self._proc):
            self.clear()
            return []
        victims = self.leftovers()
        if victims:
            log.warning("a previous agent died and left its engine running: killing PIDs %s "
                        "(engine PID %d, process group %d) before anything else", victims,
                        rec.pid, rec.pgid)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # The root may be dead already (its death signal fired) but not yet reaped by
        # whoever inherited it: a zombie still holds its PID.
        started = {pid: st.start_time for pid in {rec.pid, *victims}
                   if (st := proc.stat(pid, self._proc)) is not None}
        if rec.pid in started and started[rec.pid] != rec.start_time:
            del started[rec.pid]  # a stranger has that PID now
        deadline = self._clock() + timeout_s
        while started and self._clock() < deadline:
            started = {pid: t for pid, t in started.items()
                       if (st := proc.stat(pid, self._proc)) is not None and st.start_time == t}
            if started:
                time.sleep(0.02)
        if started:
            log.error("PIDs %s of the previous engine still exist %.0f s after SIGKILL (stuck "
                      "in the kernel, or not reaped by their parent); starting anyway, but a "
                      "restore that needs those PIDs will fail", sorted(started), timeout_s)
        self.clear()
        return victims
