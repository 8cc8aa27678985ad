"""The supervisor's word to the front: is the engine ready, and where."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pitstop.gate")


@dataclass(frozen=True)
class Ready:
    """The engine is verified and serving on `socket`; `recovery` counts engine generations,
    `path` names the ladder rung that started this one."""

    socket: Path
    recovery: int
    path: str = ""


class EngineGate:
    """Opened by the supervisor when the engine is verified, closed when it goes down.

    The front waits on it to hold requests across a restart, and counts its requests in
    flight on it so that the supervisor can wait for quiet before a snapshot. Whoever keeps
    idle connections to the engine (the front's keep-alive pool) registers a release with
    `on_quiesce`: a process tree cannot be dumped with a connection from outside open.

    Example::

        gate = EngineGate()
        gate.open(Path("/run/pitstop/engine.sock"))   # supervisor
        ready = await gate.wait_ready(timeout=30)      # front; None on timeout
    """

    def __init__(self) -> None:
        self._ready: Ready | None = None
        self._changed = asyncio.Event()
        self._recovery = 0
        self._inflight = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._admitting = True
        self._releases: list[Callable[[], Awaitable[None]]] = []
        self.down_reason = "starting"
        # When the engine went down (monotonic), so that the front can tell a short restore,
        # which it hides by holding requests, from a long outage; None while it is up.
        self.down_since: float | None = time.monotonic()

    @property
    def current(self) -> Ready | None:
        return self._ready if self._admitting else None

    @property
    def recovery(self) -> int:
        return self._recovery

    def open(self, socket: Path, path: str = "") -> None:
        self._recovery += 1
        self._ready = Ready(socket=socket, recovery=self._recovery, path=path)
        self.down_reason = ""
        self.down_since = None
        self._wake()

    def close(self, reason: str) -> None:
        self._ready = None
        self.down_reason = reason
        if self.down_since is None:
            self.down_since = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_ready(self, timeout: float, after: int = 0) -> Ready | None:
        """The ready engine, waiting up to `timeout` seconds for one; None when none came.

        `after`: only an engine of a later recovery than this will do (the front passes the
        recovery whose engine it just lost, so that it does not retry a dead one).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.current is None or self.current.recovery <= after:
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return self.current

    # Admission control, for snapshots: hold new requests, wait for those in flight.
    def pause_admission(self) -> None:
        self._admitting = False
        self._wake()

    def resume_admission(self) -> None:
        self._admitting = True
        self._wake()

    def on_quiesce(self, release: Callable[[], Awaitable[None]]) -> None:
        """Have `release` close idle connections to the engine at every `quiesce`."""
        self._releases.append(release)

    async def quiesce(self, timeout: float) -> bool:
        """Admission paused: wait for the requests in flight, then close every idle
        connection to the engine. False when requests were still running at `timeout`."""
        if not await self.wait_quiet(timeout):
            return False
        for release in self._releases:
            try:
                await release()
            except Exception:
                # Not fatal here: a connection it left open is named by the snapshot's own
                # check, which refuses the dump.
                log.exception("closing idle connections to the engine failed")
        return True

    async def wait_quiet(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._quiet.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def inflight(self) -> int:
        return self._inflight

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count one request in flight for as long as the block runs."""
        self._inflight += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._quiet.set()
