"""The vLLM-only rungs: restore from `vllm snapshot`, start warm from `vllm preload`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

from agent import proc
from agent.config import Config
from agent.engines.base import EngineAdapter
from agent.engines.vllm.cli import VllmFeatures, host_unfit
from agent.engines.vllm.parallel import Parallel
from agent.engines.vllm.preload import PreloadLink
from agent.engines.vllm.snapshot import VllmSnapshotBackend
from agent.errors import EngineError, StartPathError, VllmSnapshotError
from agent.identity import Identity
from agent.metrics import Metrics
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest, SnapshotStore
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.cold import ColdStart, ExtraArgs
from agent.supervisor.paths.restore import SnapshotRestore
from agent.supervisor.relay import UnixTcpRelay

log = logging.getLogger("pitstop.vllm")

# Failures that say the snapshot itself is bad: it is set aside, never tried again.
_BAD_SNAPSHOT = frozenset({RefusalCode.CANARY, RefusalCode.CORRUPT, RefusalCode.STALE})


class VllmSnapshotRestore(SnapshotRestore):
    """Restore the newest `vllm snapshot` of the store whose identity matches; relay
    engine.socket to it.

    vLLM checks its full identity and its own canary during the restore and leaves the
    restored engine listening on 127.0.0.1:vllm.snapshot.port; the agent adopts its root
    process (it is the subreaper) and reaches it through a Unix-socket relay.
    """

    name = "vllm-snapshot"
    reuses_held_memory = False
    kind = "vllm"
    noun = "vLLM snapshot"

    def __init__(self, backend: VllmSnapshotBackend, store: SnapshotStore, *, socket: Path,
                 identity: Callable[[], Identity], features: Callable[[], VllmFeatures],
                 has_gpu: Callable[[], bool], metrics: Metrics) -> None:
        super().__init__(backend=backend, store=store, unavailable="", identity=identity,
                         metrics=metrics)
        self._vllm = backend
        self._socket = socket
        self._features = features
        self._has_gpu = has_gpu
        self._relay: UnixTcpRelay | None = None
        # Closes the relay once the engine it serves exits; kept, or the loop could drop it.
        self._closing: asyncio.Task[None] | None = None

    def _none_yet(self) -> str:
        assert self._store is not None
        return (f"no vLLM snapshot yet in {self._store.root}; take one with "
                "`pitstop vllm-snapshot create`")

    def reconfigure(self, config: Config) -> None:
        """A reload changed what the engine is started with (agent/reload.py applies these
        keys): a snapshot taken with the old arguments must now be stale, not restored."""
        self._vllm.served_model_name = config.engine.model_name
        self._vllm.engine_args = tuple(config.engine.args)

    async def prepare(self, attempt: Attempt) -> Prepared[Manifest] | Refusal:
        # Reading vLLM's features, verifying the image and `vllm snapshot inspect` block.
        return await asyncio.to_thread(self._choose_vllm)

    def _choose_vllm(self) -> Prepared[Manifest] | Refusal:
        # vLLM's own snapshot serves engines of one worker.
        unfit = Parallel.of_args(self._vllm.engine_args).one_worker_refusal(self.name) or \
            host_unfit(self._features(), self._has_gpu(), "snapshot")
        if unfit is not None:
            return unfit
        chosen = self._choose()
        if isinstance(chosen, Refusal):
            return chosen
        # vLLM checked its own canary; the agent's recorded answer for this model must hold
        # too (canary None).
        return dataclasses.replace(chosen, canary=None)

    async def start(self, attempt: Attempt, prepared: Prepared[Manifest]) -> EngineProcess:
        assert self._store is not None
        m = prepared.plan
        await self._close_relay()
        try:
            with attempt.stage("vllm_restore"):
                restored = await proc.in_parent_thread(self._vllm.restore, m,
                                                       self._store.path(m.id))
        except VllmSnapshotError as e:
            if e.code in _BAD_SNAPSHOT:
                await self.failed(prepared, str(e), e.code)
            raise StartPathError(Refusal(
                e.code, f"vllm snapshot restore of {m.id} failed: {e}")) from e
        pid = restored.pid
        try:
            engine = EngineProcess.adopt(pid)
        except OSError as e:
            raise StartPathError(Refusal(
                RefusalCode.RESTORE_FAILED,
                f"vllm snapshot restore of {m.id} said PID {pid}, which is gone: {e}")) from e
        relay = UnixTcpRelay(self._socket, self._vllm.port)
        try:
            await relay.start()
        except OSError as e:
            await engine.kill()
            await engine.close()
            raise StartPathError(Refusal(
                RefusalCode.RELAY_FAILED,
                f"cannot relay {self._socket} to the restored engine: {e}")) from e
        self._relay = relay
        self._closing = asyncio.ensure_future(self._close_relay_after(engine))
        log.info("restored vLLM snapshot %s as PID %d (relay %s -> 127.0.0.1:%d)", m.id, pid,
                 self._socket, self._vllm.port)
        return engine

    def start_limit_s(self, prepared: Prepared[Manifest]) -> float:
        return self._vllm.restore_limit_s

    async def _close_relay_after(self, engine: EngineProcess) -> None:
        with contextlib.suppress(EngineError):
            await engine.wait()
        await self._close_relay()

    async def _close_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            await relay.close()

    async def after_verified(self, engine: EngineProcess,
                             prepared: Prepared[Manifest]) -> None:
        return None


class VllmPreloadStart(ColdStart):
    """Start vLLM fresh with `--load-format ipc_cache`: weights mapped from the GPU's
    `vllm preload` daemon over CUDA IPC instead of read from disk."""

    name = "vllm-preload"
    reuses_held_memory = True

    def __init__(self, adapter: EngineAdapter, link: PreloadLink,
                 features: Callable[[], VllmFeatures], has_gpu: Callable[[], bool]) -> None:
        super().__init__(adapter)
        self._link = link
        self._features = features
        self._has_gpu = has_gpu

    async def prepare(self, attempt: Attempt) -> Prepared[ExtraArgs] | Refusal:
        # Reading vLLM's features runs its interpreter; the daemon's health is an HTTP call.
        return await asyncio.to_thread(self._choose)

    def _choose(self) -> Prepared[ExtraArgs] | Refusal:
        if not self._link.config.vllm.preload.enabled:
            return Refusal(RefusalCode.DISABLED, "vllm.preload.enabled is false")
        unfit = host_unfit(self._features(), self._has_gpu(), "preload")
        if unfit is None:
            unfit = self._link.unavailable()
        if unfit is not None:
            return unfit
        return Prepared(self.name, tuple(self._link.engine_args()))


@dataclass(frozen=True)
class VllmHost:
    """What this host has of vLLM, read once per agent start (a vLLM or driver change means
    a restart of the agent anyway): its interpreter and environment, its features and the
    GPU (each read when first asked), and the snapshot backend chosen with them.

    Example::

        host = VllmHost.read(config)        # `auto` may run vLLM's interpreter: blocking
        first, warm = vllm_rungs(config, adapter, host, reader, criu_path, store, metrics)
    """

    python: str
    env: dict[str, str]
    features: Callable[[], VllmFeatures]
    has_gpu: Callable[[], bool]
    # "vllm" or "pitstop", and why (snapshots.backend, or what `auto` found).
    backend: str
    why: str

    @classmethod
    def read(cls, config: Config) -> VllmHost | None:
        """None for another engine than vLLM."""
        if config.engine.kind != "vllm":
            return None
        from agent.engines.vllm.cli import gpu_present, read_features
        from agent.engines.vllm.snapshot import choose_backend

        python = str(config.engine.python) if config.engine.python else sys.executable
        env = {**os.environ, **config.engine.env}
        features = cache(partial(read_features, python, env))
        has_gpu = cache(partial(gpu_present, env))
        backend, why = choose_backend(config, features, has_gpu)
        log.info("vLLM snapshots: %s backend (%s)", backend, why)
        return cls(python, env, features, has_gpu, backend, why)


def vllm_rungs(config: Config, adapter: EngineAdapter, host: VllmHost | None,
               identity: Callable[[], Identity], criu: Path | None, store: SnapshotStore,
               metrics: Metrics) -> tuple[list, list]:
    """(rungs before the ladder, rungs just above cold start) for this configuration.

    Example::

        first, warm = vllm_rungs(config, adapter, VllmHost.read(config), reader, criu_path,
                                 store, metrics)
        ladder = [*first, hybrid, refill, full, warm_start, *warm, cold]
    """
    if host is None:
        return [], []
    from agent.engines.vllm.preload import engine_gpu

    first: list = []
    warm: list = []
    if host.backend == "vllm":
        snap = VllmSnapshotBackend.from_config(config, python=host.python, criu=criu)
        first.append(VllmSnapshotRestore(snap, store, socket=config.engine_socket,
                                         identity=identity, features=host.features,
                                         has_gpu=host.has_gpu, metrics=metrics))
    if config.vllm.preload.enabled:
        link = PreloadLink(config, gpu=partial(engine_gpu, config))
        warm.append(VllmPreloadStart(adapter, link, host.features, host.has_gpu))
    return first, warm
