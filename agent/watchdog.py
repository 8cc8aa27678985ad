"""systemd's watchdog: petted only while the supervisor loop is making progress."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.config import HealthConfig
from agent.systemd import Notifier

log = logging.getLogger("pitstop")


async def pet_watchdog(notifier: Notifier, heartbeat: Callable[[], float],
                       health: Callable[[], HealthConfig],
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Pet every third of WatchdogSec while the loop's heartbeat is fresh; returns at once
    when the unit has no watchdog.

    A supervisor stuck in one step (a wedged await, a blocking call) stops beating; systemd
    then kills and restarts the agent. A health check may take its interval plus its
    timeout, so that much silence is allowed on top of two petting intervals.
    """
    interval = (notifier.watchdog_s or 0) / 3
    if interval <= 0:
        return
    while True:
        hc = health()
        stale = clock() - heartbeat()
        if stale < interval * 2 + hc.interval_s + hc.timeout_s:
            notifier.watchdog()
        else:
            log.warning("supervisor loop silent for %.1fs: not petting the watchdog", stale)
        await asyncio.sleep(interval)
