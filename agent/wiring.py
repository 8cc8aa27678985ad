"""The composition root: read what the parts need from the host, build them, run them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agent import proc
from agent.access import Access, read_access
from agent.checkpoint import build_snapshotter, build_store
from agent.checkpoint.backend import SnapshotInfo
from agent.checkpoint.snapshotter import Snapshotter
from agent.checkpoint.source import SnapshotSource
from agent.checkpoint.xcomp import process_tree
from agent.config import Config, HealthConfig
from agent.control import ControlServer
from agent.drift import Difference, describe
from agent.drift_watch import DriftWatcher, build_reader
from agent.engines import EngineAdapter, build_adapter
from agent.errors import IdentityError, ModelError, PitstopError, SnapshotError, SourceUnavailable
from agent.front.auth import take_env_key
from agent.fsutil import private_dir
from agent.gpu_health import GpuWatch
from agent.holder.client import HolderClient
from agent.holder.plans import RefillPlans, recipe_limit_s
from agent.identity import Identity, gpu_selector
from agent.metrics import EngineLabel, Metrics, NodeInfo, new_registry
from agent.metrics_endpoint import MetricsEndpoint
from agent.reload import ReloadResult
from agent.signals import Reloader, Signals
from agent.status_view import StatusBoard
from agent.store import SnapshotStore
from agent.supervisor.canary import CanaryBook
from agent.supervisor.capture import Capture
from agent.supervisor.gate import EngineGate
from agent.supervisor.gpu import GpuGuard
from agent.supervisor.ownership import EngineLedger, Tether
from agent.supervisor.paths.holder import ColdOverHolder, HolderLink, HybridRestore, WarmStart
from agent.supervisor.paths.refill import RefillRestore
from agent.supervisor.paths.restore import FullRestore, resume_timeout_s
from agent.supervisor.paths.standby import StandbyRestore
from agent.supervisor.paths.vllm import VllmHost, vllm_rungs
from agent.supervisor.remote import RemoteSnapshots
from agent.supervisor.shm import RECORD_NAME as SHM_RECORD
from agent.supervisor.shm import ShmLeftovers
from agent.supervisor.status import AgentStatus, HolderFacts, NewestSnapshot, StatusFile
from agent.supervisor.supervisor import Supervisor
from agent.systemd import Notifier
from agent.tls import LiveTls
from agent.watchdog import pet_watchdog

if TYPE_CHECKING:
    from agent.front.proxy import Front
    from agent.supervisor.status import StandbyFacts

log = logging.getLogger("pitstop")


@dataclass(frozen=True)
class Host:
    """What the agent read from the host before it builds its parts (`Agent.start`): every
    input of the build that takes I/O, so that building does none.

    Example::

        agent = Agent(config, path, Notifier(), Host.read(config))   # what Agent.start does
    """

    adapter: EngineAdapter
    access: Access
    # PITSTOP_API_KEY, taken out of the environment (no child of the agent inherits it).
    env_key: str | None
    node: NodeInfo
    snapshots: SnapshotSource
    # Why Pitstop's restore rungs have no snapshot to restore ("" with its own backend).
    no_snapshots: str
    # With SnapshotSource.PITSTOP only; CRIU's binary also runs vLLM's (`criu_path`).
    snapshotter: Snapshotter | None
    criu_path: Path | None
    # The one store every backend publishes into, verifies, quarantines and prunes.
    store: SnapshotStore
    vllm: VllmHost | None
    gpu_watch: GpuWatch | None

    @classmethod
    def read(cls, config: Config, engine: str = "") -> Host:
        """In order: the state directories, the model, the engine's adapter and version, the
        ports' keys and certificates, the snapshot backend, the GPU's watch. An error names
        the part it came from; a missing CRIU or NVML is not one (the agent runs without)."""
        with _part("the state directories"):
            private_dir(config.paths.state_dir)
            private_dir(config.paths.run)
        with _part("the model"):
            _check_model(config)
        with _part("the engine"):
            adapter = build_adapter(config)
            node = NodeInfo(engine=engine, kernel=os.uname().release,
                            engine_kind=config.engine.kind,
                            engine_version=adapter.version(), model=config.engine.model_name)
        with _part("the ports' keys and certificates"):
            env_key = take_env_key(os.environ)
            access = read_access(config, env_key)
        with _part("snapshots"):
            snapshotter, no_snapshots = _open_snapshotter(config)
            vllm = VllmHost.read(config)
        store = snapshotter.store if snapshotter is not None else build_store(config)
        criu_path = snapshotter.criu.binary.path if snapshotter is not None else None
        vllm_chosen = vllm is not None and vllm.backend == "vllm"
        snapshots = SnapshotSource.of(enabled=config.snapshots.enabled,
                                      criu_ready=snapshotter is not None, vllm=vllm_chosen)
        if vllm_chosen:
            # The configuration chose vLLM's snapshots: Pitstop's CRIU backend takes none.
            snapshotter = None
            no_snapshots = "snapshots.backend is vllm: vLLM's own snapshots are used instead"
        return cls(adapter=adapter, access=access, env_key=env_key, node=node,
                   snapshots=snapshots, no_snapshots=no_snapshots, snapshotter=snapshotter,
                   criu_path=criu_path, store=store, vllm=vllm, gpu_watch=_watch_gpu(config))


@contextlib.contextmanager
def _part(name: str) -> Iterator[None]:
    """Name the part an error of this step came from; its class stays (a configuration
    error still exits 2)."""
    try:
        yield
    except PitstopError as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (f"{name}: {e.args[0]}", *e.args[1:])
        raise


def _check_model(config: Config) -> None:
    if config.engine.kind == "reference" and not (config.engine.model / "config.json").exists():
        raise ModelError(
            f"engine.model: {config.engine.model} holds no model (no config.json); make the "
            f"tiny one with `pitstop make-model {config.engine.model}` or point engine.model "
            "at a model directory")


def _open_snapshotter(config: Config) -> tuple[Snapshotter | None, str]:
    """The snapshotter over its opened store, or None and why (CRIU missing, disabled)."""
    if not config.snapshots.enabled:
        return None, "snapshots are disabled (snapshots.enabled: false)"
    try:
        snap = build_snapshotter(config)
        snap.store.open(clean=True)
    except (SnapshotError, OSError) as e:
        log.warning("snapshots unavailable, every start will be cold: %s", e)
        return None, f"snapshots unavailable: {e}"
    return snap, ""


def _watch_gpu(config: Config) -> GpuWatch | None:
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
    log.info("watching GPU %s for faults through NVML", selector)
    return watch


class Reconfigurable(Protocol):
    def reconfigure(self, config: Config) -> None: ...


class Agent:
    """One node agent: the supervisor plus the front, metrics and systemd around it.

    Example::

        agent = Agent.start(load_config(path), path, Notifier())
        asyncio.run(agent.run())  # returns once SIGTERM stopped the engine
    """

    def __init__(self, config: Config, config_path: Path | None, notifier: Notifier,
                 host: Host, tether: Tether | None = None, engine: str = "") -> None:
        self.config = config
        # Its name among the node's engines ("" for the node's one agent).
        self.engine = engine
        self.notifier = notifier
        self.host = host
        self.adapter = host.adapter
        self.snapshotter = host.snapshotter
        self.store = host.store
        self.access = host.access
        self.gate = EngineGate()
        self.status = AgentStatus(engine=engine, engine_kind=config.engine.kind)
        self.ledger = EngineLedger(config.paths.state_dir, tether=tether)
        self.status_file = StatusFile(config.paths.run / "status.json")
        self.registry = new_registry()
        self.metrics = Metrics(self.registry)
        self.metrics_endpoint = None if not config.metrics.enabled else MetricsEndpoint(
            EngineLabel.over(self.registry, engine), config.metrics.host, config.metrics.port,
            host.access.metrics_web,
            _live(host.access.metrics_tls))
        criu = self.snapshotter.criu.binary.version if self.snapshotter is not None else None
        self.reader = build_reader(config, self.adapter, criu)
        # The identity of the engine now serving (taken just before it started): what its
        # snapshot is tagged with, and what the drift watcher compares the host against.
        self.engine_identity: Identity | None = None
        self.drifted: tuple[str, ...] = ()
        self.holder = HolderLink(config.holder, config.paths.run, gpu=self._gpu_uuid,
                                 digest=self._weights_digest, adapter=self.adapter)
        self.front = self._front(config)
        self._build_snapshots(config)
        self._tasks: set[asyncio.Task] = set()
        self._remembering: asyncio.Task | None = None
        self.gpu = GpuGuard(host.gpu_watch, drop_held=self.holder.drop, metrics=self.metrics)
        if host.gpu_watch is not None:
            self.metrics.gpu_watched()
        self.supervisor = Supervisor(
            config=config, adapter=self.adapter, paths=self._ladder(config),
            gate=self.gate, metrics=self.metrics, notifier=notifier, status=self.status,
            canaries=CanaryBook(config.paths.state_dir / "canary.json"),
            capture=self.capture, on_change=self._changed,
            before_start=self._before_start, on_ready=self._on_ready,
            status_written=self.status_file.flushed, gpu=self.gpu,
            on_engine=self.ledger.record, pull=self.remote, beside=self.standby,
            shm=ShmLeftovers(record=config.paths.state_dir / SHM_RECORD))
        self.board = StatusBoard(
            self.status, node=self._node_info, stale=self._stale_reasons,
            gpu_watched=self._gpu_watched, front_counts=self._front_counts,
            read_store=self._newest_snapshot if host.snapshots.in_store else None,
            read_holder=self._holder_facts, on_facts=self._write_status)
        self.metrics.read_status(self.board.view)
        # Built at run(): it compares against the identity read then.
        self.watcher: DriftWatcher | None = None
        self._watching: asyncio.Future[None] | None = None
        self.reloader = Reloader(config_path, current=self._current_config,
                                 apply=self.reconfigure, notifier=notifier,
                                 record=self._record_reload, prepare=self._read_access)
        self.control = ControlServer(config.paths.run / "control.sock",
                                     {"snapshot": self._control_snapshot,
                                      "status": self._control_status,
                                      "reload": self._control_reload})

    @classmethod
    def start(cls, config: Config, config_path: Path | None, notifier: Notifier,
              tether: Tether | None = None, engine: str = "") -> Agent:
        """Read what the parts need from the host, in order (Host.read: an error names the
        part), then build them; nothing runs yet (`run`). `engine` is this agent's name among
        the node's engines ("" for a node's one agent)."""
        return cls(config, config_path, notifier, Host.read(config, engine), tether, engine)

    # --- building -----------------------------------------------------------------------
    def _front(self, config: Config) -> Front | None:
        if not config.front.enabled:
            return None
        from agent.front.proxy import Front

        return Front(config.front, self.gate, self.metrics,
                     engine_metrics_path=self.adapter.metrics_path,
                     engine_dead_marker=self.adapter.dead_marker,
                     keys=self.host.access.front_keys, tls=_live(self.host.access.front_tls))

    def _build_snapshots(self, config: Config) -> None:
        """The refill's plans, the fleet's store, the capture and the restore rungs: each
        built from the ones before it."""
        host = self.host
        self.plans = RefillPlans(config.engine.model, digester=self.reader.digester)
        self.remote: RemoteSnapshots | None = None
        self.capture: Capture | None = None
        capture_failure = _no_failure
        if host.snapshotter is not None:
            # The fleet's store (snapshots.remote): Pitstop's CRIU backend's snapshots only.
            self.remote = RemoteSnapshots(
                settings=config.snapshots, store=self.store, identity=self.identity,
                remaps=host.snapshotter.remaps, holder=self.holder, plans=self.plans,
                metrics=self.metrics, status=self.status, on_change=self._changed)
            self.capture = Capture(
                host.snapshotter, self.store, self.adapter, config.engine_socket, self.gate,
                self.metrics, self.identity, config.snapshots.quiet_timeout_s,
                on_published=self._published, refill_recipe=self._refill_recipe,
                recipe_wait_s=self._recipe_wait_s)
            capture_failure = self.capture.last_failure
        self.full = FullRestore(
            snapshotter=host.snapshotter, unavailable=host.no_snapshots, adapter=self.adapter,
            socket=config.engine_socket, identity=self.identity, metrics=self.metrics,
            timeout_s=resume_timeout_s(config), capture_failure=capture_failure)
        self.hybrid = self._hybrid(config, capture_failure)
        # The refill restores with a hybrid rung of its own (its refusals are its own).
        self.refill = RefillRestore(self._hybrid(config, capture_failure), self.holder,
                                    self.plans, on_refilled=self.metrics.refilled)
        # A standby beside the live engine (snapshots.standby): restored from the hybrid
        # rung's snapshot, with that rung's checks.
        self.standby: StandbyRestore | None = None
        if config.snapshots.standby and host.snapshotter is not None:
            self.standby = StandbyRestore(
                self._hybrid(config, capture_failure), snapshotter=host.snapshotter,
                adapter=self.adapter, socket=config.engine_socket,
                timeout_s=resume_timeout_s(config), wake_ahead=config.snapshots.standby_woken,
                apart=self._standby_apart, on_change=self._standby_changed)
            self.status.standby = self.standby.facts()
        self.vllm_first, self.vllm_warm = vllm_rungs(
            config, self.adapter, host.vllm, self.identity, host.criu_path, self.store,
            self.metrics)

    def _hybrid(self, config: Config, capture_failure: Callable[[], str]) -> HybridRestore:
        return HybridRestore(
            self.holder, snapshotter=self.host.snapshotter, unavailable=self.host.no_snapshots,
            adapter=self.adapter, socket=config.engine_socket, identity=self.identity,
            metrics=self.metrics, timeout_s=resume_timeout_s(config),
            capture_failure=capture_failure)

    def _ladder(self, config: Config) -> list:
        standby = [self.standby] if self.standby is not None else []
        return [*self.vllm_first, *standby, self.hybrid, self.refill, self.full,
                WarmStart(self.adapter, self.holder),
                *self.vllm_warm,
                ColdOverHolder(self.adapter, self.holder, suspect=self._held_suspect)]

    # --- reload -------------------------------------------------------------------------
    def reconfigure(self, config: Config, result: ReloadResult) -> None:
        """Give every part that holds a reloadable value the configuration now in effect;
        each takes its own keys.

        agent/reload.py's POLICY says which keys reach here changed: the ones it refuses
        keep their running values in `config`, so setting them again changes nothing.
        """
        # First: a vLLM adapter refuses engine.args it cannot run (ConfigError), before
        # anything else took the new configuration.
        self.adapter.reconfigure(config)
        self.config = config
        parts: list[Reconfigurable | None] = [
            self.reader, self.holder, self.store, self.snapshotter, self.capture, self.remote,
            self.full, self.hybrid, self.refill, self.standby, *self.vllm_first, self.watcher]
        for part in parts:
            if part is not None:
                part.reconfigure(config)
        if self.front is not None:
            self.front.reconfigure(config.front)
        if self.watcher is not None and self._watching is not None and self._watching.done():
            # A drift check turned off, then on again: its loop had returned.
            self._watching = asyncio.ensure_future(self.watcher.run())
        self.supervisor.apply_config(config, restart_engine=result.engine_restart)

    def _current_config(self) -> Config:
        return self.config

    def _read_access(self, config: Config) -> Callable[[], None]:
        """In a worker thread at every reload: the key, certificate and web configuration
        files read again, checked against the running ports; what puts them in use."""
        access = read_access(config, self.host.env_key)
        access.fits(self.front.tls if self.front is not None else None,
                    self.metrics_endpoint.tls if self.metrics_endpoint is not None else None)
        return lambda: self._use_access(access)

    def _use_access(self, access: Access) -> None:
        self.access = access
        if self.front is not None:
            self.front.use_access(access.front_keys, access.front_tls)
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
    def _held_suspect(self) -> bool:
        return self.gpu.held_suspect

    def identity(self) -> Identity:
        """What a snapshot taken now depends on, and what a restore must match."""
        return self.engine_identity if self.engine_identity is not None else self.reader()

    def _gpu_uuid(self) -> str | None:
        return self.engine_identity.gpu_uuid if self.engine_identity is not None else None

    def _weights_digest(self) -> str | None:
        ident = self.engine_identity
        return ident.weights_digest if ident is not None else None

    def _gpu_watched(self) -> bool:
        return self.gpu.watch is not None

    def _front_counts(self) -> tuple[int, int]:
        """Requests waiting in the front, and in flight to the engine (the gate's count)."""
        return (self.front.queue_depth if self.front is not None else 0), self.gate.inflight

    async def _before_start(self) -> None:
        # Hashing changed weight files can take seconds: never on the event loop.
        self.engine_identity = await asyncio.to_thread(self.reader)
        self.drifted = ()
        self.status.engine_distribution = self.engine_identity.engine_distribution or ""
        self.status.engine_version = self.engine_identity.engine_version

    def _published(self, info: SnapshotInfo) -> None:
        assert self.remote is not None
        self.remote.published(info)
        if self.standby is not None:
            self.standby.arm_soon()  # the standby of the snapshot it replaces is torn down

    def _on_ready(self) -> None:
        if self.standby is not None:
            # After a recovery (the standby's own included): the next one, in the background.
            self.standby.arm_soon()
        if self.watcher is not None and self.engine_identity is not None:
            self.watcher.rebase(self.engine_identity)
        digest = self._weights_digest()
        if self.config.holder.enabled and digest:
            # So that a holder that restarts (or a reboot) can load these weights by itself.
            self._remembering = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.refill.remember, digest))
            self._keep(self._remembering)

    def _recipe_wait_s(self) -> float:
        """The longest a snapshot waits for the refill recipe still being made after a start
        (the first snapshot follows the first start at once): as long as the recipe of these
        weights may take, by their size."""
        weights = self.reader.last_weights
        return recipe_limit_s(sum(f.size for f in weights.files) if weights else 0)

    async def _refill_recipe(self) -> dict | None:
        """The refill recipe of the held weights, for a hybrid image to carry: once the plan
        being written after the last start is (_recipe_wait_s at most)."""
        digest = self._weights_digest()
        if not (self.config.holder.enabled and digest):
            return None
        task = self._remembering
        if task is not None and not task.done():
            wait = self._recipe_wait_s()
            try:
                await asyncio.wait_for(asyncio.shield(task), wait)
            except TimeoutError:
                log.warning("the snapshot carries no refill recipe: the refill plan was still "
                            "being made after %.0fs", wait)
                return None
            except Exception:  # noqa: BLE001 - remember() logged it; the snapshot goes on
                return None
        return await asyncio.to_thread(self.plans.recipe, self.holder.path.parent, digest)

    def _keep(self, task: asyncio.Task[None]) -> None:
        # The loop keeps only a weak reference to a task: one nobody holds may vanish.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
            return HolderFacts(up=True, bytes_held=c.stats().bytes_held,
                               bypassed=self.holder.bypassed())

    def _stale_reasons(self, snapshot_present: bool) -> tuple[str, ...]:
        rungs = [*self.vllm_first, self.full, *([self.hybrid] if snapshot_present else [])]
        reasons = {r for rung in rungs for r in rung.stale_reasons}
        return tuple(sorted({*reasons, *self.drifted} if snapshot_present else reasons))

    def _node_info(self) -> NodeInfo:
        """The node's versions as the running engine's identity saw them at its start."""
        ident = self.engine_identity
        if ident is None:
            return self.host.node
        return NodeInfo(engine=self.engine, driver_version=ident.driver_version or "",
                        cuda_driver_version=ident.cuda_driver_version or "",
                        kernel=ident.kernel, engine_kind=ident.engine_kind,
                        engine_version=ident.engine_version,
                        weights_digest=ident.weights_digest or "",
                        gpu_name=ident.gpu_name or "", model=self.config.engine.model_name)

    def _standby_apart(self) -> bool:
        """Whether a standby just armed could serve beside the dead tree of the engine now
        serving (asked off the loop). It needs none of that tree's PIDs, sockets or files;
        on a GPU it needs room: the memory free now must hold again all that the engine's
        processes use there (its CUDA context, graphs and KV pool, by NVML), or its KV pool's
        wake could fail until the dead engine's memory is given back. A KV pool kept in the
        holder is claimed by one process at a time: never beside."""
        if self.adapter.kv_claimed_in_holder():
            return False
        watch = self.gpu.watch
        if watch is None:
            # Without a GPU (none in the engine's identity) there is nothing to make room
            # for; a GPU whose memory NVML does not show gets no standby beside the dead.
            return self.config.engine.device == "cpu" or self._gpu_uuid() is None
        pid = self.status.engine_pid
        return pid is not None and watch.room_for(set(process_tree(pid)))

    def _standby_changed(self, facts: StandbyFacts) -> None:
        self.status.standby = facts
        self._changed()

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

    async def _open_ports(self) -> None:
        """The metrics endpoint, the front and the control socket, in that order."""
        if self.metrics_endpoint is not None:
            with _part("the metrics endpoint"):
                await self.metrics_endpoint.start()
            self.status.metrics = f"{self.config.metrics.host}:{self.metrics_endpoint.port}"
            self.status.metrics_access = self.access.metrics_view()
            log.info("metrics on %s://%s/metrics",
                     "https" if self.metrics_endpoint.tls else "http", self.status.metrics)
        if self.front is not None:
            with _part("the front"):
                await self.front.start()
            self.status.front = f"{self.config.front.host}:{self.front.port}"
            self.status.front_access = self.access.front_view()
            log.info("front on %s://%s/v1", "https" if self.front.tls else "http",
                     self.status.front)
        with _part("the control socket"):
            await self.control.start()

    async def _watch_drift(self) -> None:
        """Compare the host with what the serving engine (and its snapshots) were made on,
        while the agent's snapshots land in its store."""
        if not self.host.snapshots.in_store:
            return
        self.watcher = DriftWatcher(
            self.reader, reference=await asyncio.to_thread(self.reader),
            on_drift=self._on_drift, interval_s=self.config.snapshots.drift_check_interval_s,
            metrics=self.metrics)
        self._watching = asyncio.ensure_future(self.watcher.run())

    async def run(self) -> int:
        proc.become_subreaper()
        Signals(on_stop=self._on_term, reloader=self.reloader).install()
        await self._open_ports()
        self._changed()
        duties = [asyncio.ensure_future(proc.reap_forever()),
                  asyncio.ensure_future(pet_watchdog(
                      self.notifier, self._heartbeat, self._health_config)),
                  asyncio.ensure_future(self.board.run())]
        await self._watch_drift()
        try:
            await self.supervisor.run()
            self.ledger.clear()  # the supervisor stopped the engine: nothing left to kill
        finally:
            if self.standby is not None:
                await self.standby.close()
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

    def _heartbeat(self) -> float:
        return self.supervisor.heartbeat

    def _health_config(self) -> HealthConfig:
        return self.config.health


def _live(ctx: ssl.SSLContext | None) -> LiveTls | None:
    return LiveTls(ctx) if ctx is not None else None


def _no_failure() -> str:
    return ""
