"""The supervisor loop: walk the ladder, verify, watch, back off, stop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from agent.config import Config
from agent.engines.base import EngineAdapter
from agent.engines.probe import CanaryAnswer, EngineProbe
from agent.errors import EngineError, IdentityError, SnapshotError, StartPathError, VerifyError
from agent.gpu_health import GpuCheck, GpuFault, PeakSampler, Verdict
from agent.metrics import Metrics
from agent.recovery import Cause, Fall
from agent.refusal import Refusal, RefusalCode
from agent.store.manifest import CanaryMethod
from agent.supervisor.canary import CanaryBook, CanaryRecord, setup_key
from agent.supervisor.capture import Capture, CaptureResult, ResumeFailed
from agent.supervisor.engine import EngineProcess, Exit
from agent.supervisor.gate import EngineGate
from agent.supervisor.gpu import GpuGuard, ruled_out
from agent.supervisor.ladder import Attempt, Prepared, StartPath
from agent.supervisor.states import Event, State, next_state
from agent.supervisor.status import AgentStatus, Fallthrough, Recovery
from agent.systemd import Notifier

log = logging.getLogger("pitstop.supervisor")

# How often to re-arm systemd's start timeout while a long start is making progress.
EXTEND_EVERY_S = 10.0
HEALTH_POLL_S = 0.1
# How often the heartbeat is refreshed while one long step (hashing the weights, a restore,
# a dump) runs off the loop.
BEAT_S = 1.0


class Puller(Protocol):
    """Takes a snapshot from the fleet's store before a walk finds none (agent/supervisor/
    remote.py): blocking work in a thread, for at most `limit_s`."""

    @property
    def limit_s(self) -> float: ...

    async def before_walk(self, attempt: Attempt) -> None: ...


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
                 gpu: GpuGuard | None = None,
                 on_engine: Callable[[int], None] = lambda pid: None,
                 pull: Puller | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.adapter = adapter
        self.paths = list(paths)
        self.gate = gate
        self.metrics = metrics
        self.notifier = notifier
        self.status = status
        self.canaries = canaries
        self._on_change = on_change
        self.capture = capture
        self._before_start = before_start
        self._on_ready = on_ready
        self.gpu = gpu if gpu is not None else GpuGuard()
        # Samples the GPU's memory in use during a walk of the ladder (None without a GPU).
        self._sampler: PeakSampler | None = None
        self._serving_path = ""
        # Set when an NVML event says the GPU is gone while the engine may look healthy.
        self._gpu_gone: GpuFault | None = None
        # Told each new engine's PID at once, before it is verified: should the agent die
        # now, the next one must know which tree to kill.
        self._on_engine = on_engine
        self._pull = pull
        self._clock = clock
        self.state = State.STOPPED
        self.engine: EngineProcess | None = None
        self.heartbeat = clock()
        self._stop = asyncio.Event()
        self._reset = asyncio.Event()
        self._restart = asyncio.Event()
        self._wake = asyncio.Event()
        self._failures: collections.deque[float] = collections.deque()
        self._announced_ready = False
        self._cause = Cause.STARTUP
        # Set when the engine came up without a usable snapshot: take one per policy.
        self._snapshot_wanted = ""
        self._snapshot_requests: list[asyncio.Future[dict]] = []
        self._verified_canary: CanaryRecord | None = None
        self._reconfigured = False

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

    def _beat(self) -> None:
        self.heartbeat = self._clock()

    @property
    def _step_limit_s(self) -> float:
        # A start may take this long to become healthy; no single step of it takes longer.
        return self.config.health.start_timeout_s

    @property
    def _canary_timeout_s(self) -> float:
        # A canary answer is several forward passes: more than a health check may take.
        return max(self.config.health.timeout_s, 30.0)

    @property
    def _stop_limit_s(self) -> float:
        # The engine's stop timeout, then its kill and the wait for its whole tree.
        return self.config.engine.stop_timeout_s + 30.0

    @contextlib.asynccontextmanager
    async def _working(self, what: str, limit_s: float) -> AsyncIterator[None]:
        """Keep the heartbeat fresh while one long step runs (its work is in a thread or a
        child process, so the loop is free), for at most `limit_s`.

        A step may take longer than the watchdog allows the loop to be silent: a 64 GiB
        model hashed, a CUDA checkpoint and dump of 40 GB. A step past its own limit is
        stuck: the beats stop and systemd's watchdog restarts the agent. A blocking call on
        the loop stops them too, since they run on it."""
        end = self._clock() + limit_s

        async def beat() -> None:
            while self._clock() < end:
                self._beat()
                await asyncio.sleep(BEAT_S)
            log.warning("%s still running after %.0fs: the supervisor's heartbeat stops",
                        what, limit_s)

        task = asyncio.ensure_future(beat())
        try:
            yield
        finally:
            task.cancel()
            self._beat()

    async def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep; True when a stop was requested meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    # --- the loop ---------------------------------------------------------------------
    def _gpu_event(self, fault: GpuFault) -> None:
        # An engine on a lost GPU can answer /health for a long while and fail every request:
        # replace it now rather than at its next failed health check. Memory faults wait for
        # the engine's own failure, which they usually cause.
        if fault.verdict is Verdict.UNUSABLE:
            self._gpu_gone = fault
            self._wake.set()

    async def run(self) -> None:
        self.gpu.listen(self._gpu_event)
        self._fire(Event.START)
        while self.state is not State.STOPPED:
            self._beat()
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
    def _canary_key(self) -> str:
        eng = self.config.engine
        return setup_key(eng.model, [eng.kind, self.adapter.version(), eng.device, *eng.args])

    async def _start(self) -> None:
        attempt = Attempt(cause=self._cause)
        self._gpu_gone = None  # the walk's own check sees that fault
        self._sample_gpu_memory()
        t0 = self._clock()
        fallthroughs: list[Fallthrough] = []
        # Before the identity: reading a lost GPU's identity would fail, and less clearly.
        check = await self._gpu_before_walk(attempt, fallthroughs)
        if check is None:
            return
        if self._before_start is not None:
            try:
                with attempt.stage("identity"):
                    async with self._working("reading the identity", self._step_limit_s):
                        await self._before_start()
            except IdentityError as e:
                # Weights rewritten while they were hashed, an engine interpreter that cannot
                # run: this start fails and is retried with backoff; the agent lives on.
                self._stop_sampling()
                self.record_failure()
                self._fire(Event.START_FAILED, f"cannot read what the engine depends on: {e}")
                return
        await self._pull_snapshot(attempt)
        last_path = "cold"
        for path in self.paths:
            if self._stop.is_set():
                return
            last_path = path.name
            ruled = ruled_out(path, check)
            if ruled is not None:
                self._fall(path.name, Fall.GPU_FAULT, ruled, fallthroughs)
                continue
            # Off the event loop: choosing a snapshot hashes its files, asking the holder is
            # a socket round trip; health probes and the front keep running meanwhile.
            async with self._working(f"preparing {path.name}", self._step_limit_s):
                prepared = await path.prepare(attempt)
            if self._stop.is_set():
                return
            if isinstance(prepared, Refusal):
                self._fall(path.name, Fall.SKIPPED, prepared, fallthroughs)
                continue
            for stage, secs in prepared.stages.items():
                attempt.stages[stage] = attempt.stages.get(stage, 0.0) + secs
            self.notifier.status(f"starting: {path.name} ({attempt.cause})")
            try:
                limit = max(self._step_limit_s, path.start_limit_s(prepared))
                async with self._working(f"starting {path.name}", limit):
                    engine = await path.start(attempt, prepared)
            except StartPathError as e:
                self._fall(path.name, Fall.START_FAILED, e.refusal, fallthroughs)
                continue
            except EngineError as e:
                self._fall(path.name, Fall.START_FAILED,
                           Refusal(RefusalCode.ENGINE_FAILED, str(e)), fallthroughs)
                continue
            self.engine = engine
            self.status.engine_pid = engine.pid
            self._on_engine(engine.pid)
            try:
                await self._verify(engine, prepared, attempt)
                await path.after_verified(engine, prepared)
            except EngineError as e:
                await self._let_go(engine, stop=False)
                if self._stop.is_set():
                    return
                async with self._working(f"setting {path.name}'s snapshot aside",
                                         self._step_limit_s):
                    await path.failed(prepared, str(e))
                if isinstance(e, VerifyError):
                    self._fall(path.name, Fall.VERIFY_FAILED,
                               Refusal(RefusalCode.VERIFY_FAILED, str(e)), fallthroughs)
                else:
                    self._fall(path.name, Fall.START_FAILED,
                               Refusal(RefusalCode.ENGINE_FAILED, str(e)), fallthroughs)
                continue
            self._ready(path.name, attempt, self._clock() - t0, fallthroughs)
            return
        duration = self._clock() - t0
        self._record(last_path, "failure", attempt, duration, fallthroughs)
        self.record_failure()
        self._fire(Event.START_FAILED,
                   f"every start path failed: {'; '.join(map(str, fallthroughs))}")

    async def _pull_snapshot(self, attempt: Attempt) -> None:
        """Let the fleet's store give this walk a snapshot its local store lacks."""
        if self._pull is not None:
            # Off the loop like a rung's prepare: the front and the health probes go on.
            async with self._working("pulling a snapshot", self._pull.limit_s):
                await self._pull.before_walk(attempt)

    async def _gpu_check(self) -> GpuCheck:
        """The GPU's faults and health now (off the event loop), kept in the status."""
        check = await self.gpu.check()
        self.status.gpu = check.verdict.value if self.gpu.watch is not None else ""
        return check

    async def _gpu_before_walk(self, attempt: Attempt,
                               fallthroughs: list[Fallthrough]) -> GpuCheck | None:
        """The GPU's faults before a walk, held memory dropped after one; None when the GPU
        is unusable (the state is failed then)."""
        check = await self._gpu_check()
        if check.verdict is Verdict.UNUSABLE:
            self._stop_sampling()
            self._fire(Event.GPU_FAILED, self._gpu_failed_reason(check))
            return None
        if check.verdict is Verdict.MEMORY_SUSPECT:
            attempt.gpu_fault = check.describe()
            # Not a rung: what the holder did about the fault, told beside the rungs it ruled out.
            dropped = await self.gpu.drop_held(check)
            fallthroughs.append(Fallthrough("holder", Fall.GPU_FAULT, Refusal(
                RefusalCode.GPU_FAULT, f"GPU fault: {attempt.gpu_fault}; {dropped}")))
        return check

    @staticmethod
    def _gpu_failed_reason(check: GpuCheck) -> str:
        return (f"the GPU is unusable: {check.describe()}; restarting the engine cannot help. "
                "Reset or service the GPU, then restart the agent")

    def _sample_gpu_memory(self) -> None:
        """Start sampling for a walk (ending any earlier sampler); `_record` takes its peak."""
        self._stop_sampling()
        self._sampler = self.gpu.sampler()

    def _stop_sampling(self) -> int | None:
        sampler, self._sampler = self._sampler, None
        return sampler.stop() if sampler is not None else None

    def _fall(self, path: str, kind: Fall, refusal: Refusal,
              fallthroughs: list[Fallthrough]) -> None:
        fall = Fallthrough(path, kind, refusal)
        # A rung that cannot apply (no snapshot yet) is routine; one that broke is not.
        level = logging.INFO if kind is Fall.SKIPPED else logging.WARNING
        log.log(level, "ladder: %s (%s)", fall, refusal.code)
        fallthroughs.append(fall)
        self.metrics.ladder_fallthroughs.labels(path=path, reason=kind.value).inc()

    async def _verify(self, engine: EngineProcess, prepared: Prepared[Any],
                      attempt: Attempt) -> None:
        hc = self.config.health
        sock = self.config.engine_socket
        deadline = self._clock() + hc.start_timeout_s
        next_extend = self._clock()
        async with EngineProbe(sock, timeout=hc.timeout_s) as probe:
            with attempt.stage("health"):
                while True:
                    self._beat()
                    if not engine.alive:
                        raise EngineError(f"engine {engine.pid} {engine.exited.result()} "
                                          "before it became healthy; see its log above")
                    if self._stop.is_set():
                        await engine.stop(self.config.engine.stop_timeout_s)
                        raise EngineError("stop requested while starting")
                    if self._clock() >= next_extend and not self._announced_ready:
                        self.notifier.extend_timeout(EXTEND_EVERY_S * 3)
                        next_extend = self._clock() + EXTEND_EVERY_S
                    try:
                        await probe.health(self.adapter.health_path)
                        break
                    except EngineError:
                        if self._clock() >= deadline:
                            raise EngineError(
                                f"engine {engine.pid} not healthy within {hc.start_timeout_s:.0f}s"
                                " (health.start_timeout_s)") from None
                    await asyncio.sleep(HEALTH_POLL_S)
            # The canary may be asked twice (a record of an older method is made again), and
            # a first answer after a restore can be slower than the watchdog's allowance.
            with attempt.stage("verify"):
                async with self._working("the canary", hc.timeout_s + 2 * self._canary_timeout_s):
                    name = self.adapter.model_name()
                    models = await probe.models()
                    if name not in models:
                        raise VerifyError(f"engine serves {models}, not the configured model "
                                          f"{name!r}")
                    await self._verify_canary(probe, name, prepared)

    async def _verify_canary(self, probe: EngineProbe, name: str,
                             prepared: Prepared[Any]) -> None:
        """Ask the canary the way the expected answer was made and compare; with nothing
        expected yet, record this answer. A record made another way than this engine's
        current one (an older Pitstop's) is checked its own way, then made again."""
        expected = await self._expected_canary(prepared)
        current = self.adapter.canary_method
        method = current if expected is None else expected.method
        answer = await self._ask_canary(probe, name, method)
        if expected is None:
            # First start of this setup: its answer becomes the record later starts must match.
            expected = await self._record_canary(answer, current)
            log.info("canary recorded for this setup (%s): %r", current.value, answer.text)
        elif not expected.matches(answer):
            raise VerifyError(f"canary answered {answer.text!r} (tokens "
                              f"{list(answer.token_ids)}), expected the recorded "
                              f"{expected.text!r} (tokens {list(expected.token_ids)}, "
                              f"{expected.method.value}): this engine is not the one that "
                              "was recorded")
        elif expected.method is not current:
            answer = await self._ask_canary(probe, name, current)
            expected = await self._record_canary(answer, current)
            log.info("canary: the record made by %s matched; recorded again by %s: %r",
                     method.value, current.value, answer.text)
        self._verified_canary = expected

    async def _expected_canary(self, prepared: Prepared[Any]) -> CanaryRecord | None:
        if prepared.canary is not None:
            return prepared.canary
        return await asyncio.to_thread(self._recorded_canary)

    def _recorded_canary(self) -> CanaryRecord | None:
        """The record of this setup, if any. Blocking: it reads a file, lists the model's
        files and asks the engine's version (for vLLM a subprocess when its packages
        changed on disk), so it runs in a worker thread."""
        canary = self.config.health.canary
        rec = self.canaries.load()
        if rec is not None and rec.key == self._canary_key() and rec.prompt == canary.prompt \
                and rec.max_tokens == canary.max_tokens:
            return rec
        return None

    async def _ask_canary(self, probe: EngineProbe, name: str,
                          method: CanaryMethod) -> CanaryAnswer:
        hc = self.config.health
        return await probe.canary(name, hc.canary.prompt, hc.canary.max_tokens,
                                  timeout=self._canary_timeout_s,
                                  fields=self.adapter.canary_fields(method))

    async def _record_canary(self, answer: CanaryAnswer, method: CanaryMethod) -> CanaryRecord:
        canary = self.config.health.canary
        # Off the loop, as _recorded_canary; the record is written with its fsyncs.
        key = await asyncio.to_thread(self._canary_key)
        rec = CanaryRecord(key=key, prompt=canary.prompt, max_tokens=canary.max_tokens,
                           text=answer.text, token_ids=answer.token_ids, method=method)
        await asyncio.to_thread(self.canaries.save, rec)
        return rec

    def _ready(self, path: str, attempt: Attempt, duration: float,
               fallthroughs: list[Fallthrough]) -> None:
        assert self.engine is not None
        self._record(path, "success", attempt, duration, fallthroughs)
        # An engine that reuses no suspect memory serves: those faults are dealt with.
        self.gpu.acknowledge()
        self._serving_path = path
        self.status.engine_ready_since = time.time()
        policy = self.config.snapshots.regenerate
        if self.capture is not None and path in ("cold", "warm") and policy != "manual":
            self._snapshot_wanted = f"{path} start found no usable snapshot"
        if not (self._snapshot_wanted and policy == "before-serving"):
            self.gate.open(self.config.engine_socket, path)
        if self._on_ready is not None:
            self._on_ready()
        self._fire(Event.VERIFIED, f"{path} start in {duration:.2f}s ({attempt.cause})")
        if not self._announced_ready:
            self._announced_ready = True
            self.notifier.ready(f"ready: {path} start in {duration:.2f}s")
        log.info("engine %d ready via %s in %.2fs (cause %s; stages %s)", self.engine.pid, path,
                 duration, attempt.cause,
                 ", ".join(f"{k} {v:.2f}s" for k, v in attempt.stages.items()))

    def _record(self, path: str, result: str, attempt: Attempt, duration: float,
                fallthroughs: list[Fallthrough]) -> None:
        m = self.metrics
        m.recoveries.labels(path=path, result=result, cause=attempt.cause).inc()
        m.recovery_duration.labels(path=path, result=result).observe(duration)
        for stage, secs in attempt.stages.items():
            m.recovery_stage_duration.labels(path=path, stage=stage).observe(secs)
        peak = self._stop_sampling()
        if peak is not None:
            self.status.gpu_peak_bytes[path] = peak
        self.status.last_recovery = Recovery(
            path=path, cause=attempt.cause, result=result, duration_s=round(duration, 3),
            at=time.time(), stages={k: round(v, 3) for k, v in attempt.stages.items()},
            fallthroughs=fallthroughs, gpu_fault=attempt.gpu_fault, gpu_peak_bytes=peak)

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
                self._beat()
                stop = asyncio.ensure_future(self._stop.wait())
                restart = asyncio.ensure_future(self._restart.wait())
                wake = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({engine.exited, stop, restart, wake}, timeout=hc.interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                for f in (stop, restart, wake):
                    f.cancel()
                self._wake.clear()
                if self._stop.is_set():
                    return
                if self._gpu_gone is not None and not engine.exited.done():
                    fault, self._gpu_gone = self._gpu_gone, None
                    await self._engine_failed(Cause.GPU_FAULT, f"engine {engine.pid} stopped: "
                                              f"its GPU reported {fault.detail}")
                    return
                if (self._snapshot_requests or self._snapshot_wanted) \
                        and not engine.exited.done():
                    await self._snapshot(self._snapshot_wanted or "requested")
                    if self.state is not State.READY:
                        return
                    continue
                if self._restart.is_set():
                    self._restart.clear()
                    await self._replace(engine)
                    return
                if self._reconfigured:
                    self._reconfigured = False
                    return  # run() serves again, with the reloaded health settings
                if engine.exited.done():
                    exit = engine.exited.result()
                    failed = self.adapter.exit_is_failure(exit.code or 0)
                    cause = Cause.CRASH if failed else Cause.EXIT
                    await self._engine_failed(cause, f"engine {engine.pid} {exit}")
                    return
                try:
                    await probe.health(self.adapter.health_path)
                    misses = 0
                except EngineError as e:
                    misses += 1
                    log.warning("health check %d/%d failed: %s", misses,
                                hc.failures_before_restart, e)
                    if misses >= hc.failures_before_restart:
                        await self._engine_failed(
                            Cause.HANG, f"engine {engine.pid} failed {misses} health checks in a "
                            f"row ({e})")
                        return

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
            async with self._working("the snapshot", self.capture.limit_s):
                result = await self.capture.take(engine, self._verified_canary)
        except ResumeFailed as e:
            await self._resume_failed(e, waiting, regeneration)
            return
        except SnapshotError as e:
            log.error("%s", e)
            self.status.snapshot_error = self.capture.failure
            if regeneration:
                self.metrics.regenerations.labels(result="failure").inc()
            for fut in waiting:
                fut.set_exception(e)
            if not engine.alive:
                await self._engine_failed(Cause.CRASH, f"engine {engine.pid} died during a "
                                          f"snapshot: {engine.exited.result()}")
                return
            self._fire(Event.SNAPSHOT_DONE, f"snapshot failed: {e}"[:300])
            return
        self.status.snapshot_error = ""
        if regeneration:
            self.metrics.regenerations.labels(result="success").inc()
        for fut in waiting:
            fut.set_result(_summary(result))
        self._fire(Event.SNAPSHOT_DONE, f"snapshot {result.info.id} published")

    async def _resume_failed(self, e: ResumeFailed, waiting: list[asyncio.Future[dict]],
                             regeneration: bool) -> None:
        """The engine lost what its prepare dropped (its weights, its KV pool): the snapshot
        is told for what it was, and the engine is replaced through the ladder, where the
        snapshot just published (when it is sound) is what it comes back from."""
        assert self.capture is not None
        self.status.snapshot_error = self.capture.failure
        if regeneration:
            self.metrics.regenerations.labels(
                result="success" if e.published is not None else "failure").inc()
        for fut in waiting:
            if e.published is not None:
                fut.set_result({**_summary(e.published), "engine_failed": str(e)})
            else:
                fut.set_exception(SnapshotError(str(e)))
        await self._engine_failed(Cause.RESUME_FAILED, str(e))

    async def _engine_failed(self, cause: Cause, reason: str) -> None:
        self.gate.close(reason)
        check = await self._gpu_check()
        if check.verdict is not Verdict.HEALTHY:
            # Whatever the engine died of, its GPU faulted: that is the cause worth telling.
            cause = Cause.GPU_FAULT
            reason = f"{reason}, with a GPU fault: {check.describe()}"
            self.gate.close(reason)
        await self._let_go(self.engine, stop=False)
        self.status.restarts += 1
        self.metrics.engine_failures.labels(cause=cause).inc()
        self.record_failure()
        self._cause = cause
        log.error("engine failed (%s): %s", cause, reason)
        if check.verdict is Verdict.UNUSABLE:
            self._fire(Event.GPU_FAILED, self._gpu_failed_reason(check))
            return
        self._fire(Event.ENGINE_FAILED, reason)

    async def _replace(self, engine: EngineProcess) -> None:
        if self._cause is Cause.DRIFT:
            # Not urgent: let the requests in flight finish; new ones wait in the front.
            self.gate.pause_admission()
            async with self._working("waiting for requests in flight",
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
        self._failures.append(self._clock())

    def backoff_delay(self) -> tuple[float, int]:
        """(seconds to wait, failures in the window); a first failure restarts at once."""
        rc = self.config.restart
        now = self._clock()
        while self._failures and now - self._failures[0] > rc.crash_loop_window_s:
            self._failures.popleft()
        n = len(self._failures)
        if n <= 1:
            return 0.0, n
        return min(rc.backoff_max_s, rc.backoff_initial_s * rc.backoff_multiplier ** (n - 2)), n

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
        if await self._sleep_or_stop(delay):
            return
        self._restart.clear()
        self._fire(Event.BACKOFF_DONE)

    async def _failed(self) -> None:
        self._reset.clear()
        while not self._stop.is_set() and not self._reset.is_set():
            self._beat()
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
        self._stop_sampling()
        self.notifier.stopping()
        self.gate.close("stopping")
        engine = self.engine
        exit = await self._let_go(engine, stop=True)
        if engine is not None:
            log.info("engine %d stopped: %s", engine.pid, exit)
        self._fire(Event.STOPPED)

    async def _let_go(self, engine: EngineProcess | None, *, stop: bool) -> Exit | None:
        """Take `engine` down and forget it, the one way every path does: stopped (SIGTERM,
        then SIGKILL after engine.stop_timeout_s) or, with `stop` false, killed at once
        unless the agent is stopping it already; its whole tree is gone on return."""
        exit = None
        if engine is not None:
            if stop:
                async with self._working("stopping the engine", self._stop_limit_s):
                    exit = await engine.stop(self.config.engine.stop_timeout_s)
            elif not engine.stopping:
                exit = await engine.kill()
            await engine.close()
        self.engine = None
        self.status.engine_pid = None
        self.status.engine_ready_since = None
        return exit


def _summary(result: CaptureResult) -> dict:
    """What `pitstop snapshot create` is answered about a published snapshot."""
    return {"id": result.info.id, "kind": result.info.manifest.kind,
            "bytes": result.info.image_bytes, "duration_s": round(result.duration_s, 3),
            "freed_bytes": result.freed_bytes}
