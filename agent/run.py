"""`pitstop run`: wire config, supervisor, front, metrics and systemd together."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path

from prometheus_client import start_http_server

from agent import proc
from agent.checkpoint import build_snapshotter, build_store
from agent.checkpoint.snapshotter import Snapshotter
from agent.config import Config, load_config
from agent.control import ControlServer
from agent.drift import Difference, describe
from agent.drift_watch import DriftWatcher, build_reader
from agent.engines import build_adapter
from agent.engines.vllm.rungs import vllm_rungs
from agent.errors import (
    ConfigError,
    HolderError,
    IdentityError,
    ModelError,
    SnapshotError,
    SourceUnavailable,
)
from agent.fsutil import private_dir
from agent.gpu_health import GpuWatch, Verdict
from agent.holder.client import HolderClient
from agent.identity import Identity, gpu_selector
from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from agent.supervisor.canary import CanaryBook
from agent.supervisor.capture import Capture
from agent.supervisor.gate import EngineGate
from agent.supervisor.gpu import GpuGuard
from agent.supervisor.ownership import EngineLedger, StateLock, Tether
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.paths.holder import HolderLink, HybridRestore, WarmStart
from agent.supervisor.paths.restore import FullRestore
from agent.supervisor.states import State
from agent.supervisor.status import AgentStatus, StatusFile
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier

log = logging.getLogger("pitstop")

REAP_EVERY_S = 1.0


def setup_logging(verbose: bool = False) -> None:
    # Under systemd the journal stamps each line itself.
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt,
                        stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class Agent:
    """One node agent: the supervisor plus the front, metrics and systemd around it."""

    def __init__(self, config: Config, config_path: Path | None, notifier: Notifier,
                 tether: Tether | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = notifier
        if config.engine.kind == "reference" and not (config.engine.model / "config.json").exists():
            raise ModelError(
                f"engine.model: {config.engine.model} holds no model (no config.json); make the "
                f"tiny one with `pitstop make-model {config.engine.model}` or point engine.model "
                "at a model directory")
        self.adapter = build_adapter(config)
        self.gate = EngineGate()
        self.status = AgentStatus(engine_kind=config.engine.kind)
        private_dir(config.paths.state_dir)
        private_dir(config.paths.run)
        self.ledger = EngineLedger(config.paths.state_dir, tether=tether)
        self.status_file = StatusFile(config.paths.run / "status.json")
        self._node = NodeInfo(kernel=os.uname().release, engine_kind=config.engine.kind,
                              engine_version=self.adapter.version(),
                              model=config.engine.model_name)
        self.registry = new_registry()
        self.metrics = Metrics(self.registry, self.status_view)
        self.front = None
        if config.front.enabled:
            from agent.front.proxy import Front

            self.front = Front(config.front, self.gate, self.metrics,
                               engine_metrics_path=self.adapter.metrics_path,
                               engine_dead_marker=self.adapter.dead_marker)
        self.snapshotter, unavailable = self._snapshotter(config)
        # vLLM's own paths (docs/vllm.md): `vllm snapshot` first, `vllm preload` above cold.
        criu_path = self.snapshotter.criu.binary.path if self.snapshotter is not None else None
        # One store for every backend: vLLM's snapshots are published, verified and
        # quarantined in it like Pitstop's own.
        store = self.snapshotter.store if self.snapshotter is not None else build_store(config)
        vllm_first, vllm_warm = vllm_rungs(config, self.adapter, self.identity, criu_path,
                                           store, self.metrics)
        if vllm_first:
            # The configuration chose vLLM's snapshots: Pitstop's CRIU backend takes none.
            self.snapshotter = None
            unavailable = "snapshots.backend is vllm: vLLM's own snapshots are used instead"
        criu = self.snapshotter.criu.binary.version if self.snapshotter is not None else None
        self.reader = build_reader(config, self.adapter, criu)
        # The identity of the engine now serving (taken just before it started): what its
        # snapshot is tagged with, and what the drift watcher compares the host against.
        self.engine_identity: Identity | None = None
        self.drifted: tuple[str, ...] = ()
        self.capture = None
        if self.snapshotter is not None:
            snap = self.snapshotter
            self.capture = Capture(snap, snap.store, self.adapter, config.engine_socket,
                                   self.gate, self.metrics, self.identity,
                                   config.snapshots.quiet_timeout_s, keep=snap.keep,
                                   budget_bytes=snap.budget_bytes or 0)
        restore = dict(snapshotter=self.snapshotter, unavailable=unavailable,
                       adapter=self.adapter, socket=config.engine_socket,
                       identity=self.identity, metrics=self.metrics,
                       timeout_s=config.health.timeout_s * 10,
                       capture_failure=lambda: self.capture.failure if self.capture else "")
        self.full = FullRestore(**restore)
        self.holder = HolderLink(config.holder, config.paths.run, gpu=self._gpu_uuid,
                                 digest=self._weights_digest)
        self.hybrid = HybridRestore(self.holder, **restore)
        self.gpu = GpuGuard(self._watch_gpu(config), drop_held=self.holder.drop,
                            metrics=self.metrics)
        ladder = [*vllm_first, self.hybrid, self.full, WarmStart(self.adapter, self.holder),
                  *vllm_warm, ColdStart(self.adapter, extra_args=self._cold_args)]
        self.supervisor = Supervisor(
            config=config, adapter=self.adapter, paths=ladder,
            gate=self.gate, metrics=self.metrics, notifier=notifier, status=self.status,
            canaries=CanaryBook(config.paths.state_dir / "canary.json"),
            capture=self.capture, on_change=self._write_status,
            before_start=self._before_start, on_ready=self._on_ready, gpu=self.gpu,
            on_engine=self.ledger.record)
        self.watcher: DriftWatcher | None = None
        self.control = ControlServer(config.paths.run / "control.sock",
                                     {"snapshot": self._control_snapshot,
                                      "status": self._control_status})

    @staticmethod
    def _snapshotter(config: Config) -> tuple[Snapshotter | None, str]:
        """The snapshotter, or None and the reason (CRIU missing, snapshots disabled)."""
        if not config.snapshots.enabled:
            return None, "snapshots are disabled (snapshots.enabled: false)"
        try:
            snap = build_snapshotter(config)
            snap.store.open(clean=True)
        except (SnapshotError, OSError) as e:
            log.warning("snapshots unavailable, every start will be cold: %s", e)
            return None, f"snapshots unavailable: {e}"
        return snap, ""

    def _watch_gpu(self, config: Config) -> GpuWatch | None:
        """A started NVML watch of the engine's GPU; None on a host or engine without one."""
        if config.engine.device == "cpu":
            return None
        selector = gpu_selector({**os.environ, **config.engine.env})
        if selector is None:
            return None
        watch = GpuWatch(selector)
        try:
            watch.start()
        except SourceUnavailable as e:
            log.info("GPU faults are not watched: %s", e)
            return None
        except IdentityError as e:
            log.warning("GPU faults are not watched: %s", e)
            return None
        self.metrics.gpu_watched()
        log.info("watching GPU %s for faults through NVML", selector)
        return watch

    def _cold_args(self) -> list[str]:
        # Held memory that a GPU fault made suspect and the holder did not drop: load from
        # disk, not from the holder.
        return [] if self.gpu.held_suspect else self.holder.engine_args()

    def identity(self) -> Identity:
        """What a snapshot taken now depends on, and what a restore must match."""
        return self.engine_identity if self.engine_identity is not None else self.reader()

    def _gpu_uuid(self) -> str | None:
        return self.engine_identity.gpu_uuid if self.engine_identity is not None else None

    def _weights_digest(self) -> str | None:
        ident = self.engine_identity
        return ident.weights_digest if ident is not None else None

    async def _before_start(self) -> None:
        # Hashing changed weight files can take seconds: never on the event loop.
        self.engine_identity = await asyncio.to_thread(self.reader)
        self.drifted = ()
        self.status.engine_distribution = self.engine_identity.engine_distribution or ""
        self.status.engine_version = self.engine_identity.engine_version

    def _on_ready(self) -> None:
        if self.watcher is not None and self.engine_identity is not None:
            self.watcher.rebase(self.engine_identity)

    def _on_drift(self, diffs: list[Difference]) -> None:
        self.drifted = tuple(sorted({d.field for d in diffs}))
        self.supervisor.request_drift(describe(diffs))

    async def _control_snapshot(self, body: dict) -> dict:
        return await self.supervisor.request_snapshot()

    async def _control_status(self, body: dict) -> dict:
        return self.status.to_json()

    def _snapshot_fields(self) -> dict:
        if self.snapshotter is None:
            return {}
        newest = next((e for e in self.snapshotter.store.entries() if e.manifest), None)
        if newest is None or newest.manifest is None:
            return {"stale_reasons": self.full.stale_reasons}
        return {"snapshot_created": newest.manifest.created_at.timestamp(),
                "snapshot_bytes": newest.bytes_on_disk, "snapshot_kind": newest.manifest.kind,
                "stale_reasons": tuple(sorted({*self.full.stale_reasons,
                                               *self.hybrid.stale_reasons, *self.drifted}))}

    def _holder_fields(self) -> dict:
        if not self.config.holder.enabled:
            return {}
        try:
            with HolderClient(self.holder.path, timeout=2) as c:
                return {"holder_up": True, "holder_bytes": c.stats().bytes_held}
        except HolderError:
            return {"holder_up": False}

    def _node_info(self) -> NodeInfo:
        """The node's versions as the running engine's identity saw them at its start."""
        ident = self.engine_identity
        if ident is None:
            return self._node
        return NodeInfo(driver_version=ident.driver_version or "",
                        cuda_driver_version=ident.cuda_driver_version or "",
                        kernel=ident.kernel, engine_kind=ident.engine_kind,
                        engine_version=ident.engine_version,
                        weights_digest=ident.weights_digest or "",
                        gpu_name=ident.gpu_name or "", model=self.config.engine.model_name)

    def status_view(self) -> StatusView:
        return StatusView(
            state=self.status.state, engine_up=self.status.state == State.READY.value,
            engine_start_time=self.status.engine_ready_since,
            states=tuple(s.value for s in State), node=self._node_info(),
            front_queue_depth=getattr(self.front, "queue_depth", 0),
            front_inflight=self.gate.inflight, **self._snapshot_fields(),
            **self._holder_fields(),
            recovery_gpu_peak_bytes=tuple(sorted(self.status.gpu_peak_bytes.items())),
            gpu_usable=None if self.gpu.watch is None
            else self.status.gpu != Verdict.UNUSABLE.value)

    def _write_status(self) -> None:
        try:
            self.status_file.write(self.status)
        except OSError as e:
            log.warning("cannot write %s: %s", self.status_file.path, e)

    # --- signals ------------------------------------------------------------------------
    def _on_term(self) -> None:
        log.info("stop requested: draining, then stopping the engine")
        self.notifier.stopping()
        asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        if self.front is not None:
            await self.front.stop(self.config.engine.stop_timeout_s)
        self.supervisor.request_stop()

    def _on_hup(self) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
            if new.engine.kind == self.config.engine.kind:
                self.adapter.reconfigure(new)
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.notifier.reloaded()
            self.notifier.status(f"{self.supervisor.state}: reload refused: {e}"[:200])
            return
        if new.engine.kind != self.config.engine.kind:
            log.error("reload refused: engine.kind %s -> %s needs a restart of the agent "
                      "(systemctl restart pitstop-agent)", self.config.engine.kind,
                      new.engine.kind)
            self.notifier.reloaded()
            return
        if new.front != self.config.front or new.metrics != self.config.metrics \
                or new.paths != self.config.paths:
            log.warning("reload: front, metrics and paths changes take effect on restart only")
        self.config = new
        self.reader.config = new
        self.supervisor.apply_config(new)
        log.info("configuration reloaded from %s", self.config_path or "the embedded default")
        self.notifier.reloaded()

    # --- background duties ---------------------------------------------------------------
    async def _reaper(self) -> None:
        while True:
            for pid, status in proc.reap_orphans():
                log.debug("reaped orphan %d (status %d)", pid, status)
            await asyncio.sleep(REAP_EVERY_S)

    async def _watchdog(self) -> None:
        """Pet systemd's watchdog only while the supervisor loop is making progress."""
        interval = (self.notifier.watchdog_s or 0) / 3
        if interval <= 0:
            return
        while True:
            stale = time.monotonic() - self.supervisor.heartbeat
            if stale < interval * 2 + self.config.health.interval_s + self.config.health.timeout_s:
                self.notifier.watchdog()
            else:
                log.warning("supervisor loop silent for %.1fs: not petting the watchdog", stale)
            await asyncio.sleep(interval)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        proc.become_subreaper()
        loop.add_signal_handler(signal.SIGTERM, self._on_term)
        loop.add_signal_handler(signal.SIGINT, self._on_term)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        loop.add_signal_handler(signal.SIGCHLD, lambda: proc.reap_orphans())
        if self.config.metrics.enabled:
            server, _ = start_http_server(self.config.metrics.port, self.config.metrics.host,
                                          registry=self.registry)
            self.status.metrics = f"{self.config.metrics.host}:{server.server_port}"
            log.info("metrics on http://%s/metrics", self.status.metrics)
        if self.front is not None:
            await self.front.start()
            self.status.front = f"{self.config.front.host}:{self.front.port}"
            log.info("front on http://%s/v1", self.status.front)
        await self.control.start()
        self._write_status()
        duties = [asyncio.ensure_future(self._reaper()), asyncio.ensure_future(self._watchdog())]
        if self.snapshotter is not None:
            self.watcher = DriftWatcher(
                self.reader, reference=await asyncio.to_thread(self.reader),
                on_drift=self._on_drift, interval_s=self.config.snapshots.drift_check_interval_s,
                metrics=self.metrics)
            duties.append(asyncio.ensure_future(self.watcher.run()))
        try:
            await self.supervisor.run()
            self.ledger.clear()  # the supervisor stopped the engine: nothing left to kill
        finally:
            for d in duties:
                d.cancel()
            if self.front is not None:
                await self.front.stop(0)
            self.gpu.close()
            await self.control.stop()
            self._write_status()
        return 0


def run_agent(config_path: Path | None, verbose: bool = False) -> int:
    setup_logging(verbose)
    # The watchdog's SIGABRT then prints where a stuck agent was stuck, to the journal.
    faulthandler.enable()
    config = load_config(config_path)
    private_dir(config.paths.state_dir)
    # Before anything touches the state directory (the snapshot store cleans its drafts):
    # a second agent here would kill the first one's engine and corrupt its snapshots.
    with StateLock.take(config.paths.state_dir):
        # Outside systemd nothing else cleans up after an agent that was SIGKILLed.
        EngineLedger(config.paths.state_dir).kill_leftovers()
        try:
            tether = Tether.start()
            log.info("tether PID %d kills what the engine leaves should this agent die",
                     tether.pid)
        except OSError as e:
            log.warning("cannot start the tether (%s): should this agent die, what its engine "
                        "leaves is killed only when the next agent starts", e)
            tether = None
        agent = Agent(config, config_path, Notifier(), tether=tether)
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(agent.run())
    return 0
