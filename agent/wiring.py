"""The composition root: build the agent's parts from the configuration and run them."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path

from agent import proc
from agent.access import Access, read_access
from agent.checkpoint import build_snapshotter, build_store, retention
from agent.checkpoint.backend import SnapshotInfo
from agent.checkpoint.snapshotter import Snapshotter
from agent.checkpoint.source import SnapshotSource
from agent.config import Config
from agent.control import ControlServer
from agent.drift import Difference, describe
from agent.drift_watch import DriftWatcher, build_reader
from agent.engines import build_adapter
from agent.errors import IdentityError, ModelError, SnapshotError, SourceUnavailable
from agent.front.auth import take_env_key
from agent.fsutil import private_dir
from agent.gpu_health import GpuWatch
from agent.holder.client import HolderClient
from agent.holder.plans import RefillPlans
from agent.identity import Identity, gpu_selector
from agent.metrics import Metrics, NodeInfo, new_registry
from agent.metrics_endpoint import MetricsEndpoint
from agent.reload import ReloadResult
from agent.signals import Reloader, Signals
from agent.status_view import StatusBoard
from agent.supervisor.canary import CanaryBook
from agent.supervisor.capture import Capture
from agent.supervisor.gate import EngineGate
from agent.supervisor.gpu import GpuGuard
from agent.supervisor.ownership import EngineLedger, Tether
from agent.supervisor.paths.cold import ColdStart
from agent.supervisor.paths.holder import HolderLink, HybridRestore, WarmStart
from agent.supervisor.paths.refill import RefillRestore
from agent.supervisor.paths.restore import FullRestore
from agent.supervisor.paths.vllm import vllm_rungs
from agent.supervisor.remote import RemoteSnapshots
from agent.supervisor.status import AgentStatus, HolderFacts, NewestSnapshot, StatusFile
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from agent.tls import LiveTls
from agent.watchdog import pet_watchdog

log = logging.getLogger("pitstop")

# The restored engine may take this many health timeouts to answer its resume.
RESTORE_TIMEOUTS = 10


def _live(ctx: ssl.SSLContext | None) -> LiveTls | None:
    return LiveTls(ctx) if ctx is not None else None


class Agent:
    """One node agent: the supervisor plus the front, metrics and systemd around it.

    Example::

        agent = Agent(load_config(path), path, Notifier())
        asyncio.run(agent.run())  # returns once SIGTERM stopped the engine
    """

    def __init__(self, config: Config, config_path: Path | None, notifier: Notifier,
                 tether: Tether | None = None) -> None:
        self.config = config
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
        self.front = None
        self.metrics_endpoint = self._access_at_start(config)
        self.snapshotter, unavailable = self._snapshotter(config)
        # vLLM's own paths (docs/vllm.md): `vllm snapshot` first, `vllm preload` above cold.
        criu_path = self.snapshotter.criu.binary.path if self.snapshotter is not None else None
        # One store for every backend: vLLM's snapshots are published, verified, quarantined
        # and pruned in it like Pitstop's own.
        self.store = self.snapshotter.store if self.snapshotter is not None \
            else build_store(config)
        # The board is made last, from the parts it reads; a scrape before it exists cannot
        # happen (the endpoint starts in run()).
        self.metrics = Metrics(self.registry, lambda: self.board.view())
        vllm_first, vllm_warm = vllm_rungs(config, self.adapter, self.identity, criu_path,
                                           self.store, self.metrics)
        self._vllm_first = vllm_first
        if vllm_first:
            # The configuration chose vLLM's snapshots: Pitstop's CRIU backend takes none.
            self.snapshotter = None
            unavailable = "snapshots.backend is vllm: vLLM's own snapshots are used instead"
        self.snapshots = SnapshotSource.of(enabled=config.snapshots.enabled,
                                           criu_ready=self.snapshotter is not None,
                                           vllm=bool(vllm_first))
        criu = self.snapshotter.criu.binary.version if self.snapshotter is not None else None
        self.reader = build_reader(config, self.adapter, criu)
        # The identity of the engine now serving (taken just before it started): what its
        # snapshot is tagged with, and what the drift watcher compares the host against.
        self.engine_identity: Identity | None = None
        self.drifted: tuple[str, ...] = ()
        self.holder = HolderLink(config.holder, config.paths.run, gpu=self._gpu_uuid,
                                 digest=self._weights_digest, adapter=self.adapter)
        if config.front.enabled:
            from agent.front.proxy import Front

            self.front = Front(config.front, self.gate, self.metrics,
                               engine_metrics_path=self.adapter.metrics_path,
                               engine_dead_marker=self.adapter.dead_marker,
                               keys=self.access.front_keys, tls=_live(self.access.front_tls))
        self.capture = None
        if self.snapshotter is not None:
            self.capture = Capture(self.snapshotter, self.store, self.adapter,
                                   config.engine_socket, self.gate, self.metrics,
                                   self.identity, config.snapshots.quiet_timeout_s,
                                   on_published=lambda info: self._remote_published(info))
        restore = dict(snapshotter=self.snapshotter, unavailable=unavailable,
                       adapter=self.adapter, socket=config.engine_socket,
                       identity=self.identity, metrics=self.metrics,
                       timeout_s=config.health.timeout_s * RESTORE_TIMEOUTS,
                       capture_failure=lambda: self.capture.failure if self.capture else "")
        self.full = FullRestore(**restore)
        self.hybrid = HybridRestore(self.holder, **restore)
        # The refill restores with a hybrid rung of its own (its refusals are its own).
        self.refill_hybrid = HybridRestore(self.holder, **restore)
        self.refill = RefillRestore(
            self.refill_hybrid, self.holder,
            RefillPlans(config.engine.model, digester=lambda: self.reader.digester),
            on_refilled=self.metrics.refilled)
        # The fleet's store (snapshots.remote): restored by Pitstop's CRIU backend only.
        self.remote = None if self.snapshotter is None else RemoteSnapshots(
            settings=lambda: self.config.snapshots, store=self.store, identity=self.identity,
            remaps=self.snapshotter.remaps, refill=self.refill, metrics=self.metrics,
            status=self.status, on_change=self._changed)
        self._tasks: set[asyncio.Task] = set()
        self.gpu = GpuGuard(self._watch_gpu(config), drop_held=self.holder.drop,
                            metrics=self.metrics)
        ladder = [*vllm_first, self.hybrid, self.refill, self.full,
                  WarmStart(self.adapter, self.holder),
                  *vllm_warm, ColdStart(self.adapter, extra_args=self._cold_args)]
        self.supervisor = Supervisor(
            config=config, adapter=self.adapter, paths=ladder,
            gate=self.gate, metrics=self.metrics, notifier=notifier, status=self.status,
            canaries=CanaryBook(config.paths.state_dir / "canary.json"),
            capture=self.capture, on_change=self._changed,
            before_start=self._before_start, on_ready=self._on_ready, gpu=self.gpu,
            on_engine=self.ledger.record, pull=self.remote)
        self.board = StatusBoard(
            self.status, node=self._node_info, stale=self._stale_reasons,
            gpu_watched=lambda: self.gpu.watch is not None,
            front_counts=lambda: (getattr(self.front, "queue_depth", 0), self.gate.inflight),
            read_store=self._newest_snapshot if self.snapshots.in_store else None,
            read_holder=self._holder_facts, on_facts=self._write_status)
        self.watcher: DriftWatcher | None = None
        self._watching: asyncio.Future[None] | None = None
        self.reloader = Reloader(config_path, current=lambda: self.config,
                                 apply=self.reconfigure, notifier=notifier,
                                 record=self._record_reload, prepare=self._read_access)
        self.control = ControlServer(config.paths.run / "control.sock",
                                     {"snapshot": self._control_snapshot,
                                      "status": self._control_status,
                                      "reload": self._control_reload})

    def _access_at_start(self, config: Config) -> MetricsEndpoint | None:
        """At start: the ports' keys, certificates and web configuration; the metrics
        endpoint that serves with them, if metrics are on."""
        # PITSTOP_API_KEY leaves the environment here: no child of the agent inherits it.
        self._env_key = take_env_key(os.environ)
        self.access = read_access(config, self._env_key)
        if not config.metrics.enabled:
            return None
        return MetricsEndpoint(self.registry, config.metrics.host, config.metrics.port,
                               self.access.metrics_web, _live(self.access.metrics_tls))

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

    # --- reload -------------------------------------------------------------------------
    def reconfigure(self, config: Config, result: ReloadResult) -> None:
        """Give every part that holds a reloadable value the configuration now in effect.

        agent/reload.py's POLICY says which keys reach here changed: the ones it refuses
        keep their running values in `config`, so setting them again changes nothing.
        """
        # First: a vLLM adapter refuses engine.args it cannot run (ConfigError), before
        # anything else took the new configuration.
        self.adapter.reconfigure(config)
        self.config = config
        self.reader.config = config
        self.holder.config = config.holder
        snaps = config.snapshots
        if self.capture is not None:
            self.capture.quiet_timeout_s = snaps.quiet_timeout_s
        # keep, disk_budget_gib, quarantine_keep: whichever backend publishes into the store.
        self.store.retention = retention(config)
        self.store.trust_sealed = snaps.verify == "changed"
        if self.snapshotter is not None:
            self.snapshotter.cuda.lock_timeout_ms = snaps.cuda_lock_timeout_ms
        for rung in (self.full, self.hybrid, self.refill_hybrid):
            rung.timeout_s = config.health.timeout_s * RESTORE_TIMEOUTS
        for vllm_rung in self._vllm_first:
            vllm_rung.reconfigure(config)
        if self.front is not None:
            self.front.reconfigure(config.front)
        if self.watcher is not None:
            self.watcher.interval_s = snaps.drift_check_interval_s
            if self._watching is not None and self._watching.done():
                self._watching = asyncio.ensure_future(self.watcher.run())
        self.supervisor.apply_config(config, restart_engine=result.engine_restart)

    def _read_access(self, config: Config) -> Callable[[], None]:
        """In a worker thread at every reload: the key, certificate and web configuration
        files read again, checked against the running ports; what puts them in use."""
        access = read_access(config, self._env_key)
        access.fits(self.front.tls if self.front is not None else None,
                    self.metrics_endpoint.tls if self.metrics_endpoint is not None else None)
        return lambda: self._use_access(access)

    def _use_access(self, access: Access) -> None:
        self.access = access
        if self.front is not None:
            self.front.keys = access.front_keys
            if self.front.tls is not None and access.front_tls is not None:
                self.front.tls.use(access.front_tls)
            self.status.front_access = access.front_view()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.use(access.metrics_web, access.metrics_tls)
            self.status.metrics_access = access.metrics_view()
        log.info("access read again: front %s, metrics %s", self.status.front_access,
                 self.status.metrics_access)

    def _record_reload(self, result: ReloadResult) -> None:
        self.status.last_reload = result
        self._changed()

    async def _control_reload(self, body: dict) -> dict:
        return (await self.reloader.reload()).to_json()

    # --- what the ladder and the status view ask --------------------------------------
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
        digest = self._weights_digest()
        if self.config.holder.enabled and digest:
            # So that a holder that restarts (or a reboot) can load these weights by itself.
            self._keep(asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.refill.remember, digest)))

    def _keep(self, task: asyncio.Task[None]) -> None:
        # The loop keeps only a weak reference to a task: one nobody holds may vanish.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remote_published(self, info: SnapshotInfo) -> None:
        if self.remote is not None:
            self.remote.published(info)

    async def _watch_drift(self) -> None:
        """Compare the host with what the serving engine (and its snapshots) were made on."""
        self.watcher = DriftWatcher(
            self.reader, reference=await asyncio.to_thread(self.reader),
            on_drift=self._on_drift, interval_s=self.config.snapshots.drift_check_interval_s,
            metrics=self.metrics)
        self._watching = asyncio.ensure_future(self.watcher.run())

    def _on_drift(self, diffs: list[Difference]) -> None:
        self.drifted = tuple(sorted({d.field for d in diffs}))
        self.board.publish()
        self.supervisor.request_drift(describe(diffs))

    async def _control_snapshot(self, body: dict) -> dict:
        return await self.supervisor.request_snapshot()

    async def _control_status(self, body: dict) -> dict:
        return self.status.to_json()

    def _newest_snapshot(self) -> NewestSnapshot | None:
        """Blocking (it lists the store): the status view calls it in a worker thread."""
        newest = next((e for e in self.store.entries() if e.manifest), None)
        if newest is None or newest.manifest is None:
            return None
        return NewestSnapshot(id=newest.id, kind=newest.manifest.kind,
                              created=newest.manifest.created_at.timestamp(),
                              bytes_on_disk=newest.bytes_on_disk)

    def _holder_facts(self) -> HolderFacts | None:
        """Blocking (a socket round trip): the status view calls it in a worker thread."""
        if not self.holder.config.enabled:
            return None
        with HolderClient(self.holder.path, timeout=2) as c:
            return HolderFacts(up=True, bytes_held=c.stats().bytes_held)

    def _stale_reasons(self, snapshot_present: bool) -> tuple[str, ...]:
        rungs = [*self._vllm_first, self.full, *([self.hybrid] if snapshot_present else [])]
        reasons = {r for rung in rungs for r in rung.stale_reasons}
        return tuple(sorted({*reasons, *self.drifted} if snapshot_present else reasons))

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

    def _changed(self) -> None:
        self.board.changed()
        self._write_status()

    def _write_status(self) -> None:
        self.status_file.post(self.status)

    # --- running ------------------------------------------------------------------------
    def _on_term(self) -> None:
        log.info("stop requested: draining, then stopping the engine")
        self.notifier.stopping()
        self._keep(asyncio.get_running_loop().create_task(self._drain_then_stop()))

    async def _drain_then_stop(self) -> None:
        if self.front is not None:
            await self.front.stop(self.config.engine.stop_timeout_s)
        self.supervisor.request_stop()

    async def run(self) -> int:
        proc.become_subreaper()
        Signals(on_stop=self._on_term, reloader=self.reloader).install()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.start()
            self.status.metrics = f"{self.config.metrics.host}:{self.metrics_endpoint.port}"
            self.status.metrics_access = self.access.metrics_view()
            log.info("metrics on %s://%s/metrics",
                     "https" if self.metrics_endpoint.tls else "http", self.status.metrics)
        if self.front is not None:
            await self.front.start()
            self.status.front = f"{self.config.front.host}:{self.front.port}"
            self.status.front_access = self.access.front_view()
            log.info("front on %s://%s/v1", "https" if self.front.tls else "http",
                     self.status.front)
        await self.control.start()
        self._changed()
        duties = [asyncio.ensure_future(proc.reap_forever()),
                  asyncio.ensure_future(pet_watchdog(
                      self.notifier, lambda: self.supervisor.heartbeat,
                      lambda: self.config.health)),
                  asyncio.ensure_future(self.board.run())]
        if self.snapshots.in_store:
            await self._watch_drift()
        try:
            await self.supervisor.run()
            self.ledger.clear()  # the supervisor stopped the engine: nothing left to kill
        finally:
            for d in [*duties, self._watching]:
                if d is not None:
                    d.cancel()
            if self.front is not None:
                await self.front.stop(0)
            self.gpu.close()
            if self.metrics_endpoint is not None:
                await self.metrics_endpoint.stop()
            await self.control.stop()
            self._write_status()
            await self.status_file.flushed()
        return 0
