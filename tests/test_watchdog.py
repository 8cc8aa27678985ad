"""systemd's watchdog is petted while the supervisor loop beats, and not once it is silent."""

from __future__ import annotations

import asyncio

from agent.config import HealthConfig
from agent.systemd import Notifier
from agent.watchdog import pet_watchdog


class Recording(Notifier):
    def __init__(self, watchdog_s: float | None) -> None:
        super().__init__({"WATCHDOG_USEC": str(int(watchdog_s * 1e6))} if watchdog_s else {})
        self.pets = 0

    def watchdog(self) -> None:
        self.pets += 1


def _run(notifier: Recording, heartbeat: float, now: float, seconds: float = 0.2) -> None:
    health = HealthConfig(interval_s=1.0, timeout_s=1.0)

    async def main() -> None:
        task = asyncio.ensure_future(pet_watchdog(notifier, lambda: heartbeat, lambda: health,
                                                  clock=lambda: now))
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(main())


def test_a_beating_loop_is_petted_every_third_of_the_watchdog_interval() -> None:
    n = Recording(watchdog_s=0.3)
    _run(n, heartbeat=100.0, now=100.5, seconds=0.25)
    assert 2 <= n.pets <= 3  # at 0, 0.1 and (on a machine not too loaded) 0.2 s


def test_a_loop_silent_past_two_intervals_and_a_health_check_is_not_petted() -> None:
    n = Recording(watchdog_s=0.3)
    # Allowed: 2 x 0.1 s + interval_s 1 + timeout_s 1 = 2.2 s of silence.
    _run(n, heartbeat=100.0, now=102.3)
    assert n.pets == 0


def test_without_a_watchdog_it_returns_at_once() -> None:
    n = Recording(watchdog_s=None)
    _run(n, heartbeat=0.0, now=1e9)
    assert n.pets == 0
