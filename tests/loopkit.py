"""Is the event loop free while some work runs: a ticker on it, and a file system made slow."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

TICK_S = 0.01


@dataclass(frozen=True)
class Ticks:
    """How often a 10 ms ticker ran while the work ran, and its longest wait for the loop."""

    count: int
    longest_s: float


async def ticks_while(work: Awaitable[Any]) -> tuple[Any, Ticks]:
    """What `work` returned, and how the ticker on the same loop fared meanwhile.

    Health probes, the front and the watchdog run on this loop: a blocked loop ticks zero
    times while it is blocked, a free one about a hundred times a second (less on a busy
    machine)."""
    count, longest = 0, 0.0
    last = time.monotonic()

    async def ticker() -> None:
        nonlocal count, longest, last
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            count, longest, last = count + 1, max(longest, now - last), now

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is running before the work starts
    try:
        result = await work
    finally:
        t.cancel()
    return result, Ticks(count, max(longest, time.monotonic() - last))


def slow_disk(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """From now on every fsync, rename and replace in this process waits `seconds` first:
    a disk a CRIU dump is filling, whose journal makes each of them wait."""

    def slowed(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return real(*args, **kwargs)
        return call

    for name in ("fsync", "rename", "replace"):
        monkeypatch.setattr(os, name, slowed(getattr(os, name)))
