"""The supervisor's sign of life, which systemd's watchdog is fed from while it is fresh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

log = logging.getLogger("pitstop.supervisor")

# How often the heartbeat is refreshed while one long step (hashing the weights, a restore,
# a dump) runs off the loop.
BEAT_S = 1.0


class Heartbeat:
    """When the supervisor last showed it is not stuck (`at`, on the injected clock):
    agent/watchdog.py pets systemd's watchdog only while it is recent.

    Example::

        heart = Heartbeat(time.monotonic)
        heart.beat()                                    # each turn of the loop
        async with heart.working("the snapshot", 1800):
            await capture.take(...)                     # beats on, for at most 1800 s
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.at = clock()

    def beat(self) -> None:
        self.at = self._clock()

    @contextlib.asynccontextmanager
    async def working(self, what: str, limit_s: float) -> AsyncIterator[None]:
        """Keep the heartbeat fresh while one long step runs (its work is in a thread or a
        child process, so the loop is free), for at most `limit_s`.

        A step may take longer than the watchdog allows the loop to be silent: a 64 GiB
        model hashed, a CUDA checkpoint and dump of 40 GB. A step past its own limit is
        stuck: the beats stop and systemd's watchdog restarts the agent. A blocking call on
        the loop stops them too, since they run on it."""
        end = self._clock() + limit_s

        async def beat() -> None:
            while self._clock() < end:
                self.beat()
                await asyncio.sleep(BEAT_S)
            log.warning("%s still running after %.0fs: the supervisor's heartbeat stops",
                        what, limit_s)

        task = asyncio.ensure_future(beat())
        try:
            yield
        finally:
            task.cancel()
            self.beat()
