"""The supervisor loop: walk the ladder, verify, watch, back off, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agent.config import Config, HealthConfig
from agent.engines.base import EngineAdapter
from agent.engines.probe import EngineProbe
from agent.errors import EngineError, IdentityError, SnapshotError, StartPathError, VerifyError
from agent.gpu_health import GpuCheck, GpuFault, Verdict
from agent.metrics import Metrics
from agent.recovery import Cause, Fall
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.backoff import Failures, Lead
from agent.supervisor.canary import CanaryBook, CanaryCheck, CanaryRecord
from agent.supervisor.capture import Capture, ResumeFailed
from agent.supervisor.engine import EngineProcess, Exit
from agent.supervisor.gate import EngineGate
from agent.supervisor.gpu import GpuGuard, ruled_out, unusable
from agent.supervisor.heartbeat import BEAT_S, Heartbeat
from agent.supervisor.ladder import (
    Attempt,
    Beside,
    Prepared,
    Puller,
    StartPath,
    StopRequested,
)
from agent.supervisor.shm import ShmLeftovers
from agent.supervisor.states import Event, State, next_state
from agent.supervisor.status import AgentStatus, Recovery
from agent.supervisor.verify import Verifier
from agent.systemd import Notifier

log = logging.getLogger("pitstop.supervisor")


class Supervisor:
    """Owns the engine: starts it through the ladder, keeps it healthy, stops it.

    Example::

        sup = Supervisor(config=cfg, adapter=adapter, paths=[ColdStart(adapter)], gate=gate,
                         metrics=metrics, notifier=Notifier(), status=AgentStatus(),
                         canaries=CanaryBook(state_dir / "canary.json"))
        await sup.run()  # returns after request_stop()
    """

    def __init__(self, *, config: Config, adapter: EngineAdapter,
                 paths: Sequence[StartPath[Any]],
                 gate: EngineGate, metrics: Metrics, notifier: Notifier, status: AgentStatus,
                 canaries: CanaryBook, on_change: Callable[[], None] = lambda: None,
                 capture: Capture | None = None,
                 before_start: Callable[[], Awaitable[None]] | None = None,
                 on_ready: Callable[[], None] | None = None,
                 status_written: Callable[[], Awaitable[None]] | None = None,
                 gpu: GpuGuard | None = None,
                 on_engine: Callable[[int], None] = lambda pid: None,
                 pull: Puller | None = None,
                 shm: ShmLeftovers | None = None,
                 beside: Beside | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.adapter = adapter
        self.paths = list(paths)
        self.gate = gate
        self.metrics = metrics
        self.notifier = notifier
        self.status = status
        self._on_change = on_change
        self.capture = capture
        self._before_start = before_start
        self._on_ready = on_ready
        # READY=1 waits for it: whoever `systemctl restart` returned to reads this recovery.
        self._status_written = status_written
        self.gpu = gpu if gpu is not None else GpuGuard()
        self._serving_path = ""
        # Set when an NVML event says the GPU is gone while the engine may look healthy.
        self._gpu_gone: GpuFault | None = None
        # Told each new engine's PID at once, before it is verified: should the agent die
        # now, the next one must know which tree to kill.
        self._on_engine = on_engine
        self._pull = pull
        # What a killed tree left in /dev/shm, removed after the next engine is ready.
        self.shm = shm if shm is not None else ShmLeftovers()
        # The rung tried while a dead engine's tree is still going (the standby), and the
        # teardowns of such trees still under way: every other rung, and a stop, wait for them.
        self._beside = beside
        self._dying: set[asyncio.Task[None]] = set()
        self._clock = clock
        self.state = State.STOPPED
        self.engine: EngineProcess | None = None
        self._heart = Heartbeat(clock)
        self._stop = asyncio.Event()
        self._verifier = Verifier(adapter, CanaryCheck(canaries, adapter), self._heart,
                                  self._stop, notifier, clock)
        self._reset = asyncio.Event()
        self._restart = asyncio.Event()
        self._wake = asyncio.Event()
        self._failures = Failures(clock)
        self._announced_ready = False
        self._cause = Cause.STARTUP
        # Set when the engine came up without a usable snapshot: take one per policy.
        self._snapshot_wanted = ""
        self._snapshot_requests: list[asyncio.Future[dict]] = []
        self._verified_canary: CanaryRecord | None = None
        self._reconfigured = False
        self._lead = Lead(clock)

    # --- control from outside (signals) -------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def request_restart(self, cause: Cause) -> None:
        """Replace a serving engine through the ladder (a reload changed the engine)."""
        self._cause = cause
        self._restart.set()

    def apply_config(self, config: Config, *, restart_engine: bool) -> None:
        """Take a reloaded configuration (agent/reload.py decided what is in it); with
        `restart_engine`, replace a serving engine through the ladder."""
        self.config = config
        self.request_reset()
        # The serving loop holds the health settings it started with: make it start again.
        self._reconfigured = True
        self._wake.set()
        if restart_engine and self.state in (State.READY, State.BACKOFF):
            self.request_restart(Cause.RELOAD)

    def request_snapshot(self) -> asyncio.Future[dict]:
        """Take a snapshot at the next quiet moment; the future gets its summary."""
        if self.capture is None:
            raise SnapshotError("snapshots are not available on this host: "
                                "see `pitstop doctor`")
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._snapshot_requests.append(fut)
        self._wake.set()
        return fut

    def request_drift(self, summary: str) -> None:
        """The running engine and its snapshot no longer match the host (weights, driver,
        engine changed): replace the engine when idle, per snapshots.regenerate."""
        if self.config.snapshots.regenerate == "manual":
            log.warning("drift (%s): snapshot stale; regenerate: manual, so the engine keeps "
                        "running until it is restarted", summary)
            return
        log.warning("drift (%s): the engine will be replaced at the next quiet moment%s",
                    summary, " and a fresh snapshot taken" if self.capture is not None else
                    "; take a fresh snapshot with `pitstop vllm-snapshot create`")
        if self.state in (State.READY, State.SNAPSHOTTING):
            self.request_restart(Cause.DRIFT)

    def request_reset(self) -> None:
        """Clear a crash loop (on reload): the next walk of the ladder starts at once."""
        self._failures.clear()
        self._reset.set()

    # --- state ------------------------------------------------------------------------
    def _fire(self, event: Event, reason: str = "") -> None:
        new = next_state(self.state, event)
        log.info("state %s -> %s on %s%s", self.state, new, event, f": {reason}" if reason else "")
        self.state = new
        self.status.state = new.value
        self.status.state_since = time.time()
        self.status.reason = reason
        self.notifier.status(f"{new}" + (f": {reason}" if reason else ""))
        self._on_change()

    @property
    def heartbeat(self) -> float:
        """When the loop last showed it is not stuck (what systemd's watchdog is fed by)."""
        return self._heart.at

    @property
    def _step_limit_s(self) -> float:
        # A start may take this long to become healthy; no single step of it takes longer.
        return self.config.health.start_timeout_s

    @property
    def _stop_limit_s(self) -> float:
        # The engine's stop timeout, then its kill and the wait for its whole tree.
        return self.config.engine.stop_timeout_s + 30.0

    # --- the loop ---------------------------------------------------------------------
    def _gpu_lost(self, fault: GpuFault) -> None:
        # An engine on a lost GPU can answer /health for a long while and fail every request:
        # replace it now rather than at its next failed health check.
        self._gpu_gone = fault
        self._wake.set()

    async def run(self) -> None:
        self.gpu.listen(self._gpu_lost)
        self._fire(Event.START)
        while self.state is not State.STOPPED:
            self._heart.beat()
            if self._stop.is_set() and self.state is not State.STOPPING:
                self._fire(Event.STOP)
            if self.state is State.STARTING:
                await self._start()
            elif self.state is State.READY:
                await self._serve()
            elif self.state is State.BACKOFF:
                await self._backoff()
            elif self.state is State.FAILED:
                await self._failed()
            elif self.state is State.STOPPING:
                await self._shutdown()

    # --- starting ---------------------------------------------------------------------
    async def _start(self) -> None:
        attempt = Attempt(cause=self._cause)
        self._gpu_gone = None  # the walk's own check sees that fault
        self.gpu.start_sampling()
        t0 = self._clock()
        # Before the identity: reading a lost GPU's identity would fail, and less clearly.
        check = await self._gpu_before_walk(attempt)
        if check is None or not await self._read_identity(attempt):
            return
        await self._pull_snapshot(attempt)
        for path in self.paths:
            if self._stop.is_set():
                return
            try:
                engine = await self._try(path, attempt, check)
            except StopRequested:
                return
            if engine is not None:
                await self._ready(path.name, attempt, self._clock() - t0)
                return
        last_path = self.paths[-1].name if self.paths else "cold"
        self._record(last_path, "failure", attempt, self._clock() - t0)
        self.record_failure()
        self._fire(Event.START_FAILED,
                   f"every start path failed: {'; '.join(map(str, attempt.fallthroughs))}")

    async def _read_identity(self, attempt: Attempt) -> bool:
        """Take what this start depends on (before_start); False when it cannot be read,
        and this start has failed."""
        if self._before_start is None:
            return True
        try:
            with attempt.stage("identity"):
                async with self._heart.working("reading the identity", self._step_limit_s):
                    await self._before_start()
        except IdentityError as e:
            # Weights rewritten while they were hashed, an engine interpreter that cannot
            # run: this start fails and is retried with backoff; the agent lives on.
            self.gpu.stop_sampling()
            self.record_failure()
            self._fire(Event.START_FAILED, f"cannot read what the engine depends on: {e}")
            return False
        return True

    async def _try(self, path: StartPath[Any], attempt: Attempt,
                   check: GpuCheck) -> EngineProcess | None:
        """One rung: prepared off the loop, started, verified. The engine, or None when the
        rung fell through (in the attempt's fallthroughs); StopRequested when a stop came
        meanwhile."""
        ruled = ruled_out(path, check)
        if ruled is not None:
            self._fall(attempt, path.name, Fall.GPU_FAULT, ruled)
            return None
        if self._beside is None or path.name != self._beside.name:
            await self._dead_trees_gone()
        # Off the event loop: choosing a snapshot hashes its files, asking the holder is
        # a socket round trip; health probes and the front keep running meanwhile.
        async with self._heart.working(f"preparing {path.name}", self._step_limit_s):
            prepared = await path.prepare(attempt)
        if self._stop.is_set():
            raise StopRequested
        if isinstance(prepared, Refusal):
            self._fall(attempt, path.name, Fall.SKIPPED, prepared)
            return None
        for stage, secs in prepared.stages.items():
            attempt.stages[stage] = attempt.stages.get(stage, 0.0) + secs
        engine = await self._start_rung(path, attempt, prepared)
        if engine is None:
            return None
        try:
            self._verified_canary = await self._verifier.verify(
                self.config, engine, prepared.canary, attempt,
                extend=not self._announced_ready)
            await path.after_verified(engine, prepared)
        except EngineError as e:
            await self.shm.failed(engine.pid)
            await self._let_go(engine, stop=False)
            if self._stop.is_set():
                raise StopRequested from e
            async with self._heart.working(f"setting {path.name}'s snapshot aside",
                                           self._step_limit_s):
                await path.failed(prepared, str(e))
            if isinstance(e, VerifyError):
                self._fall(attempt, path.name, Fall.VERIFY_FAILED,
                           Refusal(RefusalCode.VERIFY_FAILED, str(e)))
            else:
                self._fall(attempt, path.name, Fall.START_FAILED,
                           Refusal(RefusalCode.ENGINE_FAILED, str(e)))
            return None
        return engine

    async def _start_rung(self, path: StartPath[Any], attempt: Attempt,
                          prepared: Prepared[Any]) -> EngineProcess | None:
        """The engine `path` starts from `prepared`, told to the ledger at once; None when
        the start failed (in the attempt's fallthroughs)."""
        self.notifier.status(f"starting: {path.name} ({attempt.cause})")
        try:
            limit = max(self._step_limit_s, path.start_limit_s(prepared))
            async with self._heart.working(f"starting {path.name}", limit):
                engine = await path.start(attempt, prepared)
        except StartPathError as e:
            self._fall(attempt, path.name, Fall.START_FAILED, e.refusal)
            return None
        except EngineError as e:
            self._fall(attempt, path.name, Fall.START_FAILED,
                       Refusal(RefusalCode.ENGINE_FAILED, str(e)))
            return None
        self.engine = engine
        self.status.engine_pid = engine.pid
        self._on_engine(engine.pid)
        return engine

    async def _pull_snapshot(self, attempt: Attempt) -> None:
        """Let the fleet's store give this walk a snapshot its local store lacks (off the
        loop, like a rung's prepare: the front and the health probes go on)."""
        if self._pull is not None:
            async with self._heart.working("pulling a snapshot", self._pull.limit_s):
                await self._pull.before_walk(attempt)

    async def _gpu_check(self, attempt: Attempt | None = None) -> GpuCheck:
        """The GPU's faults and health now (off the event loop), kept in the status; before
        a walk (`attempt`), held memory a fault made suspect is dropped."""
        check = await self.gpu.check(attempt)
        self.status.gpu = check.verdict.value if self.gpu.watch is not None else ""
        return check

    async def _gpu_before_walk(self, attempt: Attempt) -> GpuCheck | None:
        """The GPU's faults before a walk; None when the GPU is unusable (state failed)."""
        check = await self._gpu_check(attempt)
        if check.verdict is Verdict.UNUSABLE:
            self.gpu.stop_sampling()
            self._fire(Event.GPU_FAILED, unusable(check))
            return None
        return check

    def _fall(self, attempt: Attempt, path: str, kind: Fall, refusal: Refusal) -> None:
        attempt.fall(path, kind, refusal)
        self.metrics.ladder_fallthroughs.labels(path=path, reason=kind.value).inc()

    async def _ready(self, path: str, attempt: Attempt, duration: float) -> None:
        assert self.engine is not None
        self._record(path, "success", attempt, duration)
        # An engine that reuses no suspect memory serves: those faults are dealt with.
        self.gpu.acknowledge()
        self._serving_path = path
        self.status.engine_ready_since = time.time()
        policy = self.config.snapshots.regenerate
        # An engine no image serves (several workers: Capture.refusal) is not snapshotted.
        if (self.capture is not None and self.capture.refusal() is None
                and path in ("cold", "warm") and policy != "manual"):
            self._snapshot_wanted = f"{path} start found no usable snapshot"
        if not (self._snapshot_wanted and policy == "before-serving"):
            self.gate.open(self.config.engine_socket, path)
        if self._on_ready is not None:
            self._on_ready()
        self._fire(Event.VERIFIED, f"{path} start in {duration:.2f}s ({attempt.cause})")
        if not self._announced_ready:
            if self._status_written is not None:
                await self._status_written()
            self._announced_ready = True
            self.notifier.ready(f"ready: {path} start in {duration:.2f}s")
        log.info("engine %d ready via %s in %.2fs (cause %s; stages %s)", self.engine.pid, path,
                 duration, attempt.cause,
                 ", ".join(f"{k} {v:.2f}s" for k, v in attempt.stages.items()))
        # After the gate opened: the survey and the sweep run while the engine serves.
        self.shm.ready(self.engine.pid)

    def _record(self, path: str, result: str, attempt: Attempt, duration: float) -> None:
        self.metrics.recovered(path, result, attempt.cause, duration, attempt.stages)
        peak = self.gpu.stop_sampling()
        if peak is not None:
            self.status.gpu_peak_bytes[path] = peak
        down_at, lead_s = self._lead.take()
        self.status.last_recovery = Recovery(
            path=path, cause=attempt.cause, result=result, duration_s=round(duration, 3),
            at=time.time(), stages={k: round(v, 3) for k, v in attempt.stages.items()},
            fallthroughs=attempt.fallthroughs, gpu_fault=attempt.gpu_fault,
            gpu_peak_bytes=peak, down_at=down_at, lead_s=lead_s)

    # --- serving ----------------------------------------------------------------------
    async def _serve(self) -> None:
        engine = self.engine
        assert engine is not None
        if self._snapshot_wanted:
            await self._snapshot(self._snapshot_wanted)
            if self.state is not State.READY:
                return
        if self.gate.current is None:
            self.gate.open(self.config.engine_socket, self._serving_path)
        hc = self.config.health
        misses = 0
        async with EngineProbe(self.config.engine_socket, timeout=hc.timeout_s) as probe:
            while True:
                self._heart.beat()
                await self._wait_serving(engine, hc.interval_s)
                if self._stop.is_set():
                    return
                leave = await self._serving_event(engine)
                if leave is not None:
                    if leave:
                        return
                    continue
                misses = await self._health_check(probe, engine, hc, misses)
                if misses < 0:
                    return

    async def _wait_serving(self, engine: EngineProcess, interval_s: float) -> None:
        """Until the engine exits, something is asked of the supervisor, or `interval_s`."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self._stop, self._restart, self._wake)]
        await asyncio.wait({engine.exited, *waits}, timeout=interval_s,
                           return_when=asyncio.FIRST_COMPLETED)
        for f in waits:
            f.cancel()
        self._wake.clear()

    async def _serving_event(self, engine: EngineProcess) -> bool | None:
        """Act on what woke the serving loop: True when it is to return (the engine is
        gone, replaced, or the loop restarts with reloaded settings), False when it is to
        wait again, None when nothing happened and the engine's health is due."""
        if self._gpu_gone is not None and not engine.exited.done():
            fault, self._gpu_gone = self._gpu_gone, None
            await self._engine_failed(Cause.GPU_FAULT, f"engine {engine.pid} stopped: "
                                      f"its GPU reported {fault.detail}")
            return True
        if (self._snapshot_requests or self._snapshot_wanted) and not engine.exited.done():
            await self._snapshot(self._snapshot_wanted or "requested")
            return self.state is not State.READY
        if self._restart.is_set():
            self._restart.clear()
            await self._replace(engine)
            return True
        if self._reconfigured:
            self._reconfigured = False
            return True  # run() serves again, with the reloaded health settings
        if engine.exited.done():
            exit = engine.exited.result()
            failed = self.adapter.exit_is_failure(exit.code or 0)
            await self._engine_failed(Cause.CRASH if failed else Cause.EXIT,
                                      f"engine {engine.pid} {exit}")
            return True
        return None

    async def _health_check(self, probe: EngineProbe, engine: EngineProcess,
                            hc: HealthConfig, misses: int) -> int:
        """The engine's health checks failed in a row, counting this one; -1 once that is
        `health.failures_before_restart` and the engine was failed for a hang."""
        try:
            await probe.health(self.adapter.health_path)
            return 0
        except EngineError as e:
            misses += 1
            log.warning("health check %d/%d failed: %s", misses, hc.failures_before_restart, e)
            if misses < hc.failures_before_restart:
                return misses
            await self._engine_failed(Cause.HANG, f"engine {engine.pid} failed {misses} "
                                      f"health checks in a row ({e})")
            return -1

    async def _snapshot(self, why: str) -> None:
        """Snapshot the serving engine (READY -> SNAPSHOTTING -> READY, or BACKOFF when the
        engine cannot serve after it)."""
        engine = self.engine
        waiting, self._snapshot_requests = self._snapshot_requests, []
        regeneration = bool(self._snapshot_wanted)
        self._snapshot_wanted = ""
        assert engine is not None and self.capture is not None
        if self._verified_canary is None:
            err = SnapshotError("the engine has no verified canary answer to record")
            for fut in waiting:
                fut.set_exception(err)
            return
        self._fire(Event.SNAPSHOT, why)
        try:
            async with self._heart.working("the snapshot", self.capture.limit_s):
                result = await self.capture.take(engine, self._verified_canary)
        except ResumeFailed as e:
            # The engine lost what it detached: it is replaced through the ladder, where the
            # snapshot just published (when it is sound) is what it comes back from.
            self._tell(waiting, regeneration, SnapshotError(str(e)) if e.published is None
                       else {**e.published.summary(), "engine_failed": str(e)})
            await self._engine_failed(Cause.RESUME_FAILED, str(e))
            return
        except SnapshotError as e:
            log.error("%s", e)
            self._tell(waiting, regeneration, e)
            if not engine.alive:
                await self._engine_failed(Cause.CRASH, f"engine {engine.pid} died during a "
                                          f"snapshot: {engine.exited.result()}")
                return
            self._fire(Event.SNAPSHOT_DONE, f"snapshot failed: {e}"[:300])
            return
        self._tell(waiting, regeneration, result.summary())
        self._fire(Event.SNAPSHOT_DONE, f"snapshot {result.info.id} published")

    def _tell(self, waiting: list[asyncio.Future[dict]], regeneration: bool,
              answer: dict | SnapshotError) -> None:
        """A snapshot's outcome to the status, the regenerations counter and whoever asked."""
        assert self.capture is not None
        self.status.snapshot_error = self.capture.failure
        failed = isinstance(answer, SnapshotError)
        if regeneration:
            self.metrics.regenerations.labels(result="failure" if failed else "success").inc()
        for fut in waiting:
            if isinstance(answer, SnapshotError):
                fut.set_exception(answer)
            else:
                fut.set_result(answer)

    async def _engine_failed(self, cause: Cause, reason: str) -> None:
        engine = self.engine
        self._lead.down(engine.exited_at if engine is not None and engine.exited_at
                        else time.time())
        self.gate.close(reason)
        # The tree is killed at once and torn down while the GPU is read: a restore waits
        # for both (the tree's PIDs, the GPU's faults), and neither needs the other. A
        # standby needs neither the tree's PIDs nor its memory: it is tried while the tree
        # goes, and the rungs after it wait for the tree (_try).
        beside = self._beside
        behind = engine is not None and beside is not None and beside.serves_beside_dead()
        with self._lead.span("teardown"):
            if behind:
                assert engine is not None and beside is not None
                self._tear_down_behind(engine, beside.name)
                check = await self._gpu_check()
            else:
                check, _ = await asyncio.gather(self._gpu_check(),
                                                self._let_go(engine, stop=False))
        if check.verdict is not Verdict.HEALTHY:
            # Whatever the engine died of, its GPU faulted: that is the cause worth telling.
            cause = Cause.GPU_FAULT
            reason = f"{reason}, with a GPU fault: {check.describe()}"
            self.gate.close(reason)
        self.status.restarts += 1
        self.metrics.engine_failures.labels(cause=cause).inc()
        self.record_failure()
        self._cause = cause
        log.error("engine failed (%s): %s (%s)", cause, reason,
                  "its tree torn down behind" if behind
                  else f"its tree gone in {self._lead.spans['teardown']:.3f}s")
        if check.verdict is Verdict.UNUSABLE:
            self._fire(Event.GPU_FAILED, unusable(check))
            return
        self._fire(Event.ENGINE_FAILED, reason)

    async def _replace(self, engine: EngineProcess) -> None:
        if self._cause is Cause.DRIFT:
            # Not urgent: let the requests in flight finish; new ones wait in the front.
            self.gate.pause_admission()
            async with self._heart.working("waiting for requests in flight",
                                     self.config.snapshots.quiet_timeout_s + BEAT_S):
                await self.gate.wait_quiet(self.config.snapshots.quiet_timeout_s)
        self.gate.close(f"restarting: {self._cause}")
        self.gate.resume_admission()
        exit = await self._let_go(engine, stop=True)
        log.info("engine %d stopped for a restart (%s): %s", engine.pid, self._cause, exit)
        self._fire(Event.RESTART, self._cause)

    # --- backing off ------------------------------------------------------------------
    def record_failure(self) -> None:
        """Count one failed start or engine failure towards backoff and the crash loop."""
        self._failures.record()

    def backoff_delay(self) -> tuple[float, int]:
        """(seconds to wait, failures in the window); a first failure restarts at once."""
        return self._failures.delay(self.config.restart)

    async def _backoff(self) -> None:
        delay, n = self.backoff_delay()
        limit = self.config.restart.crash_loop_limit
        if n > limit:
            window = self.config.restart.crash_loop_window_s
            self._fire(Event.CRASH_LOOP,
                       f"crash loop: {n} failures within {window:.0f}s (restart.crash_loop_limit);"
                       " fix the engine, then reload the agent")
            return
        if delay > 0:
            log.info("backing off %.1fs before the next start (%d recent failures)", delay, n)
            with self._lead.span("backoff"), contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
        if self._stop.is_set():
            return
        self._restart.clear()
        self._fire(Event.BACKOFF_DONE)

    async def _failed(self) -> None:
        self._reset.clear()
        while not self._stop.is_set() and not self._reset.is_set():
            self._heart.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reset.wait(), 1.0)
        if self._reset.is_set() and not self._stop.is_set():
            self._cause = Cause.RESET
            # The operator says the cause was fixed: faults seen so far are history. The next
            # walk reads the GPU's health afresh and fails again if it still is unusable.
            self.gpu.acknowledge()
            self._fire(Event.RESET, "reset by reload")

    # --- stopping ---------------------------------------------------------------------
    async def _shutdown(self) -> None:
        self.gpu.stop_sampling()
        self.notifier.stopping()
        self.gate.close("stopping")
        await self._dead_trees_gone()
        engine = self.engine
        exit = await self._let_go(engine, stop=True)
        if engine is not None:
            log.info("engine %d stopped: %s", engine.pid, exit)
        self._fire(Event.STOPPED)

    async def _let_go(self, engine: EngineProcess | None, *, stop: bool) -> Exit | None:
        """Take `engine` down and forget it, the one way every path does: stopped (SIGTERM,
        then SIGKILL after engine.stop_timeout_s) or, with `stop` false, killed at once
        unless the agent is stopping it already; its whole tree is gone on return."""
        exit = await self._take_down(engine, stop=stop) if engine is not None else None
        self._forget_engine()
        return exit

    async def _take_down(self, engine: EngineProcess, *, stop: bool) -> Exit | None:
        """_let_go's half that waits: the engine stopped or killed, its tree gone."""
        exit = None
        if stop:
            async with self._heart.working("stopping the engine", self._stop_limit_s):
                exit = await engine.stop(self.config.engine.stop_timeout_s)
        elif not engine.stopping:
            exit = await engine.kill()
        await engine.close()
        return exit

    def _forget_engine(self) -> None:
        self.engine = None
        self.status.engine_pid = None
        self.status.engine_ready_since = None

    def _tear_down_behind(self, engine: EngineProcess, rung: str) -> None:
        """Forget `engine` now and take its tree down in the background, as _let_go would
        (_dead_trees_gone waits for it), while `rung` is tried."""
        log.info("engine %d: its tree is torn down while the %s rung is tried", engine.pid, rung)
        self._forget_engine()
        task = asyncio.ensure_future(self._take_down(engine, stop=False))
        self._dying.add(task)
        task.add_done_callback(self._dying.discard)

    async def _dead_trees_gone(self) -> None:
        """Until the trees torn down behind a standby's start are gone (their PIDs free,
        their GPU memory given back): what every other rung, and a stop, need first."""
        if not self._dying:
            return
        async with self._heart.working("waiting for a dead engine's tree", self._stop_limit_s):
            for res in await asyncio.gather(*self._dying, return_exceptions=True):
                if isinstance(res, Exception):
                    log.error("the teardown of a dead engine's tree failed: %s", res)
