"""One engine process tree as the supervisor sees it: started or restored, watched, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent import proc
from agent.engines.base import LaunchSpec
from agent.errors import EngineError

log = logging.getLogger("pitstop.engine")

# How long a kill waits for the rest of the engine's group after its root is reaped.
GROUP_GONE_TIMEOUT_S = 30.0
# How soon the group is looked at again when all that is left of it are zombies: the kernel
# hands each to us (the subreaper) as its parent exits, and a reap is due at once.
ZOMBIES_AGAIN_S = 0.005
# The most end_with reads of its pipe: one short line.
READ_LIMIT = 1 << 12


def _group_held(root: int) -> list[int]:
    """The processes that still hold the engine's group or session ID (`root`)."""
    # Members re-parented to the agent are its zombies until reaped: reap them here too.
    proc.reap_orphans()
    # The root itself is reaped already: a process with its PID now is someone else's.
    return [pid for pid in proc.id_holders(root) if pid != root]


@dataclass(frozen=True)
class Exit:
    """How an engine process ended: exit code, or the signal that killed it."""

    code: int | None
    signal: int | None

    def __str__(self) -> str:
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        return f"exited with status {self.code}"


class EngineProcess:
    """A running engine, known by a pidfd so a recycled PID can never fool us.

    Example::

        eng = EngineProcess.spawn(adapter.launch_spec())
        exit = await eng.wait()
    """

    def __init__(self, pid: int, stdout: int | None = None,
                 health_path: str | None = None) -> None:
        self.pid = pid
        # The engine's access-log line for a health check the agent made and it passed:
        # one a second, which would bury the engine's own lines in the journal. A failed
        # check (any other status) is still logged.
        self._quiet = f'"GET {health_path} HTTP/1.1" 200' if health_path else None
        self.started = time.monotonic()
        # When its exit was seen (wall clock, for the status): None while it runs.
        self.exited_at: float | None = None
        self._pidfd = os.pidfd_open(pid)
        self._exit: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        self._stopping = False
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pidfd, self._on_exit)
        self._log_task = None
        if stdout is not None:
            self._log_task = asyncio.ensure_future(self._forward_log(stdout))

    @classmethod
    def spawn(cls, spec: LaunchSpec, health_path: str | None = None,
              pass_fds: tuple[int, ...] = ()) -> EngineProcess:
        """Start the engine from the calling thread, which must live as long as the agent
        (the event loop's): the engine is SIGKILLed when that thread exits. `pass_fds` stay
        open in it (a standby's report pipe)."""
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        # The wrapper execs the engine, so a missing program would only show as its exit
        # status: name it here, as Popen would have.
        if shutil.which(spec.argv[0], path=env.get("PATH")) is None:
            raise EngineError(f"cannot start the engine {spec.argv[0]!r}: no such program "
                              "(check engine.python or the engine's installation)")
        try:
            with proc.spawn_lock():
                p = subprocess.Popen(
                    proc.with_deathsig(list(spec.argv), spec.small_root), env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True, pass_fds=pass_fds)
                proc.own(p.pid)
        except OSError as e:
            raise EngineError(f"cannot start the engine {spec.argv[0]!r}: {e.strerror}") from e
        # Popen must not wait on it later; the pidfd is the one owner of its status.
        p.returncode = 0
        assert p.stdout is not None
        fd = os.dup(p.stdout.fileno())
        p.stdout.close()
        return cls(p.pid, stdout=fd, health_path=health_path)

    @classmethod
    def adopt(cls, pid: int, stdout: int | None = None,
              health_path: str | None = None) -> EngineProcess:
        """A process tree restored by CRIU, re-parented to us as its subreaper."""
        proc.own(pid)
        return cls(pid, stdout=stdout, health_path=health_path)

    def end_with(self, fd: int, read: Callable[[bytes], Exit | None]) -> None:
        """Take this engine as dead once `fd` (a pipe whose other end the engine's own root
        process's reaper holds) says so: `read` makes an Exit of what arrives, or None. The
        process we started (a namespace's maker) only exits once every process of its
        namespace is gone; the engine it runs is dead before that. `fd` is ours to close."""
        loop = asyncio.get_running_loop()

        def ready() -> None:
            loop.remove_reader(fd)
            try:
                data = os.read(fd, READ_LIMIT)
            except OSError:
                data = b""
            finally:
                os.close(fd)
            exit = read(data)
            if exit is not None and not self._exit.done():
                self.exited_at = time.time()
                self._exit.set_result(exit)

        loop.add_reader(fd, ready)

    def _on_exit(self) -> None:
        if self.exited_at is None:
            self.exited_at = time.time()
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        exit = Exit(code=None, signal=None)
        try:
            res = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            res = None  # not our child after all (reaped elsewhere): status unknown
        if res is not None:
            if res.si_code == os.CLD_EXITED:
                exit = Exit(code=res.si_status, signal=None)
            else:
                exit = Exit(code=None, signal=res.si_status)
        proc.disown(self.pid)
        os.close(self._pidfd)
        if not self._exit.done():
            self._exit.set_result(exit)

    async def _forward_log(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
        try:
            while line := await reader.readline():
                text = line.decode(errors="replace").rstrip()
                if self._quiet is None or self._quiet not in text:
                    log.info("[%d] %s", self.pid, text)
        except (ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            transport.close()

    @property
    def exited(self) -> asyncio.Future[Exit]:
        return self._exit

    @property
    def alive(self) -> bool:
        return not self._exit.done()

    @property
    def stopping(self) -> bool:
        """True once the agent itself asked the engine to stop."""
        return self._stopping

    async def wait(self) -> Exit:
        return await asyncio.shield(self._exit)

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    async def _kill_group(self) -> None:
        """SIGKILL the engine's process group and whatever descends from its root.

        The engine leads its own session and group, so the group also holds children that
        outlived their parent and were re-parented to us (vLLM's engine core after its API
        server died): walking the tree from the root alone would miss them. The group goes
        first, in one call; the walk (for descendants that left the group) reads /proc, off
        the loop, and only from a live root: a dead one's children are ours already.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.alive:
            await asyncio.to_thread(proc.kill_tree, self.pid, signal.SIGKILL)

    async def kill(self) -> Exit:
        """SIGKILL the whole tree, reap the root, and wait for the rest of it to be gone."""
        self._stopping = True
        await self._kill_group()
        exit = await self.wait()
        await self._group_gone()
        return exit

    async def _group_gone(self, timeout: float = GROUP_GONE_TIMEOUT_S) -> None:
        """Wait until no process holds the engine's session or group ID (its members exit
        after the root, and one holding tens of GiB takes seconds): until then the ID, which
        a restore must give back to the same root, cannot be allocated, and their GPU memory
        is not free for a cold start. Each wait ends when the kernel says the members still
        there have exited (their pidfds), not at a polling tick."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            held = await asyncio.to_thread(_group_held, self.pid)
            if not held:
                return
            left = end - loop.time()
            if left <= 0:
                log.warning("engine %d: processes of its group are still there %.0f s after "
                            "SIGKILL: %s", self.pid, timeout, sorted(held))
                return
            if not await proc.exits(held, left):
                await asyncio.sleep(ZOMBIES_AGAIN_S)

    async def stop(self, timeout: float) -> Exit:
        """SIGTERM the root (the engine drains its own children), wait, then SIGKILL all."""
        self._stopping = True
        if self.alive:
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)  # a stopped engine must run to see the SIGTERM
            try:
                exit = await asyncio.wait_for(self.wait(), timeout)
            except TimeoutError:
                log.warning("engine %d did not stop within %.0fs; killing it", self.pid, timeout)
            else:
                await self._kill_group()  # leftovers of a tree whose root already exited
                await self._group_gone()
                return exit
        return await self.kill()

    async def close(self) -> None:
        if self._log_task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._log_task, 2)
