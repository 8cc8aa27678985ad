"""Verifying an engine a rung started: healthy in time, serving the model, the canary's answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agent.config import Config
from agent.engines.base import EngineAdapter
from agent.engines.probe import EngineProbe
from agent.errors import EngineError
from agent.supervisor.canary import CanaryCheck, CanaryRecord
from agent.supervisor.engine import EngineProcess
from agent.supervisor.heartbeat import Heartbeat
from agent.supervisor.ladder import Attempt
from agent.systemd import Notifier

# How often to re-arm systemd's start timeout while a long start is making progress.
EXTEND_EVERY_S = 10.0
HEALTH_POLL_S = 0.1


class Verifier:
    """Holds an engine a rung started to what the agent reports ready: healthy within
    health.start_timeout_s, serving the configured model, and giving the recorded canary
    answer (agent/supervisor/canary.py); EngineError (VerifyError) when it does not.

    Example::

        verifier = Verifier(adapter, CanaryCheck(book, adapter), heart, stop, notifier)
        record = await verifier.verify(config, engine, prepared.canary, attempt, extend=True)
    """

    def __init__(self, adapter: EngineAdapter, canary: CanaryCheck, heart: Heartbeat,
                 stop: asyncio.Event, notifier: Notifier,
                 clock: Callable[[], float]) -> None:
        self._adapter = adapter
        self._canary = canary
        self._heart = heart
        self._stop = stop
        self._notifier = notifier
        self._clock = clock

    async def verify(self, config: Config, engine: EngineProcess,
                     expected: CanaryRecord | None, attempt: Attempt, *,
                     extend: bool) -> CanaryRecord:
        """The canary record `engine` answered as; with `extend`, systemd's start timeout
        is re-armed while it becomes healthy (before the agent's first READY)."""
        hc = config.health
        async with EngineProbe(config.engine_socket, timeout=hc.timeout_s) as probe:
            with attempt.stage("health"):
                await self._healthy(config, engine, probe, extend=extend)
            # The canary may be asked twice (a record of an older method is made again), and
            # a first answer after a restore can be slower than the watchdog's allowance.
            limit = hc.timeout_s + 2 * self._canary.timeout_s(config)
            with attempt.stage("verify"):
                async with self._heart.working("the canary", limit):
                    return await self._canary.verify(config, probe, expected)

    async def _healthy(self, config: Config, engine: EngineProcess, probe: EngineProbe, *,
                       extend: bool) -> None:
        hc = config.health
        deadline = self._clock() + hc.start_timeout_s
        next_extend = self._clock()
        while True:
            self._heart.beat()
            if not engine.alive:
                raise EngineError(f"engine {engine.pid} {engine.exited.result()} "
                                  "before it became healthy; see its log above")
            if self._stop.is_set():
                await engine.stop(config.engine.stop_timeout_s)
                raise EngineError("stop requested while starting")
            if extend and self._clock() >= next_extend:
                self._notifier.extend_timeout(EXTEND_EVERY_S * 3)
                next_extend = self._clock() + EXTEND_EVERY_S
            try:
                await probe.health(self._adapter.health_path)
                return
            except EngineError:
                if self._clock() >= deadline:
                    raise EngineError(
                        f"engine {engine.pid} not healthy within {hc.start_timeout_s:.0f}s"
                        " (health.start_timeout_s)") from None
            await asyncio.sleep(HEALTH_POLL_S)
