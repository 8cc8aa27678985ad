"""The vLLM-only rungs: restore from `vllm snapshot`, start warm from `vllm preload`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from agent import proc
from agent.config import Config
from agent.drift import describe
from agent.engines.base import EngineAdapter
from agent.engines.vllm.cli import VllmFeatures
from agent.engines.vllm.preload import PreloadLink
from agent.engines.vllm.snapshot import VllmManifest, VllmSnapshotBackend, precheck
from agent.errors import EngineError, StartPathError, VllmSnapshotError
from agent.identity import Identity
from agent.refusal import Refusal, RefusalCode
from agent.supervisor.engine import EngineProcess
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.cold import ColdStart, ExtraArgs
from agent.supervisor.relay import UnixTcpRelay

log = logging.getLogger("pitstop.vllm")

# Failures that say the snapshot itself is bad: it is set aside, never tried again.
_BAD_SNAPSHOT = frozenset({RefusalCode.CANARY, RefusalCode.CORRUPT, RefusalCode.STALE})


def host_unfit(features: VllmFeatures, has_gpu: bool, what: str) -> Refusal | None:
    """Why this host cannot run vLLM's `what` subcommand (snapshot, preload); None if it can."""
    if features.distribution is None:
        return Refusal(RefusalCode.NO_VLLM, "engine.python has no vLLM installed")
    present = features.snapshot if what == "snapshot" else features.preload
    if not present:
        return Refusal(RefusalCode.UNSUPPORTED,
                       f"the installed vLLM ({features.describe()}) has no `vllm {what}`")
    missing = []
    if not features.cuda_build:
        missing.append(f"the installed vLLM ({features.describe()}) is not a CUDA build")
    if not has_gpu:
        missing.append("this host has no NVIDIA GPU")
    if missing:
        return Refusal(RefusalCode.NO_CUDA, f"{' and '.join(missing)}; `vllm {what}` needs CUDA")
    return None


class VllmSnapshotRestore:
    """Restore the newest `vllm snapshot` whose identity matches; relay engine.socket to it.

    vLLM checks its full identity and its own canary during the restore and leaves the
    restored engine listening on 127.0.0.1:vllm.snapshot.port; the agent adopts its root
    process (it is the subreaper) and reaches it through a Unix-socket relay.
    """

    name = "vllm-snapshot"
    reuses_held_memory = False

    def __init__(self, backend: VllmSnapshotBackend, *, socket: Path,
                 identity: Callable[[], Identity], features: Callable[[], VllmFeatures],
                 has_gpu: Callable[[], bool]) -> None:
        self._backend = backend
        self._socket = socket
        self._identity = identity
        self._features = features
        self._has_gpu = has_gpu
        self._relay: UnixTcpRelay | None = None
        # The refusal codes of the snapshots passed over when none was usable, for
        # `pitstop_snapshot_stale`; () once one is chosen.
        self.stale_reasons: tuple[RefusalCode, ...] = ()

    def reconfigure(self, config: Config) -> None:
        """A reload changed what the engine is started with (agent/reload.py applies these
        keys): a snapshot taken with the old arguments must now be stale, not restored."""
        self._backend.served_model_name = config.engine.model_name
        self._backend.engine_args = tuple(config.engine.args)

    async def prepare(self, attempt: Attempt) -> Prepared[VllmManifest] | Refusal:
        # Reading vLLM's features and `vllm snapshot inspect` run vLLM's interpreter.
        return await asyncio.to_thread(self._choose)

    def _choose(self) -> Prepared[VllmManifest] | Refusal:
        unfit = host_unfit(self._features(), self._has_gpu(), "snapshot")
        if unfit is not None:
            return unfit
        paths = self._backend.candidates()
        if not paths:
            return Refusal(RefusalCode.NO_SNAPSHOT,
                           f"no vLLM snapshot yet in {self._backend.root}; take one with "
                           "`pitstop vllm-snapshot create`")
        refused: list[str] = []
        codes: set[RefusalCode] = set()
        host = self._identity()
        for path in paths:
            try:
                m = self._backend.inspect(path)
            except VllmSnapshotError as e:
                refused.append(f"{path.name}: {e}")
                codes.add(e.code)
                continue
            mismatch = self._mismatch(m, host)
            if mismatch is None:
                self.stale_reasons = ()
                # vLLM checked its own canary; the agent's recorded answer for this model
                # must hold too (canary None).
                return Prepared(self.name, m)
            refused.append(f"{path.name}: {mismatch.code}: {mismatch.detail}")
            codes.add(mismatch.code)
        self.stale_reasons = tuple(sorted(codes))
        return Refusal(RefusalCode.NO_USABLE_SNAPSHOT,
                       "no usable vLLM snapshot: " + "; ".join(refused))

    def _mismatch(self, m: VllmManifest, host: Identity) -> Refusal | None:
        b = self._backend
        if (m.model, m.model_revision) != (b.model, b.revision):
            return Refusal(RefusalCode.STALE,
                           f"it holds {m.model}@{m.model_revision[:12]}, vllm.snapshot asks for "
                           f"{b.model}@{b.revision[:12]}")
        want = b.expected_argv()
        if m.engine_argv != want:
            # Positions shift when a flag is added; naming the words on either side reads best.
            old = [a for a in m.engine_argv if a not in want]
            new = [a for a in want if a not in m.engine_argv]
            parts = ([f"only the snapshot has {old}"] if old else []) + \
                ([f"only the configuration has {new}"] if new else [])
            said = " and ".join(parts) or "same words, another order"
            return Refusal(RefusalCode.STALE, f"engine_args differ: {said} (engine.args or "
                           "engine.served_model_name changed)")
        diffs = precheck(m, host)
        return Refusal(RefusalCode.STALE, describe(diffs)) if diffs else None

    async def start(self, attempt: Attempt, prepared: Prepared[VllmManifest]) -> EngineProcess:
        m = prepared.plan
        await self._close_relay()
        try:
            with attempt.stage("vllm_restore"):
                pid = await proc.in_parent_thread(self._backend.restore, m)
        except VllmSnapshotError as e:
            if e.code in _BAD_SNAPSHOT:
                self.failed(prepared, str(e))
            raise StartPathError(Refusal(
                e.code, f"vllm snapshot restore of {m.id} failed: {e}")) from e
        try:
            engine = EngineProcess.adopt(pid)
        except OSError as e:
            raise StartPathError(Refusal(
                RefusalCode.RESTORE_FAILED,
                f"vllm snapshot restore of {m.id} said PID {pid}, which is gone: {e}")) from e
        relay = UnixTcpRelay(self._socket, self._backend.port)
        try:
            await relay.start()
        except OSError as e:
            await engine.kill()
            await engine.close()
            raise StartPathError(Refusal(
                RefusalCode.RELAY_FAILED,
                f"cannot relay {self._socket} to the restored engine: {e}")) from e
        self._relay = relay
        asyncio.ensure_future(self._close_relay_after(engine))
        log.info("restored vLLM snapshot %s as PID %d (relay %s -> 127.0.0.1:%d)", m.id, pid,
                 self._socket, self._backend.port)
        return engine

    async def _close_relay_after(self, engine: EngineProcess) -> None:
        with contextlib.suppress(EngineError):
            await engine.wait()
        await self._close_relay()

    async def _close_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            await relay.close()

    async def after_verified(self, engine: EngineProcess,
                             prepared: Prepared[VllmManifest]) -> None:
        return None

    def failed(self, prepared: Prepared[VllmManifest], reason: str) -> None:
        m = prepared.plan
        # A dot name: never a candidate again, kept for a post-mortem (vLLM's child.log).
        dest = m.path.with_name(f".refused-{m.id}")
        try:
            os.rename(m.path, dest)
            log.error("vLLM snapshot %s set aside as %s: %s", m.id, dest, reason)
        except OSError as e:
            log.error("vLLM snapshot %s failed (%s) and could not be set aside: %s", m.id,
                      reason, e)


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


def vllm_rungs(config: Config, adapter: EngineAdapter, identity: Callable[[], Identity],
               criu: Path | None) -> tuple[list, list]:
    """(rungs before the ladder, rungs just above cold start) for this configuration.

    Example::

        first, warm = vllm_rungs(config, adapter, reader, criu_path)
        ladder = [*first, hybrid, full, warm_start, *warm, cold]
    """
    if config.engine.kind != "vllm":
        return [], []
    from functools import cache

    from agent.engines.vllm.cli import gpu_present, read_features
    from agent.engines.vllm.preload import engine_gpu
    from agent.engines.vllm.snapshot import choose_backend

    python = str(config.engine.python) if config.engine.python else sys.executable
    env = {**os.environ, **config.engine.env}
    # Read once per agent start: a vLLM or driver change means a restart of the agent anyway.
    features = cache(lambda: read_features(python, env))
    has_gpu = cache(lambda: gpu_present(env))
    first: list = []
    warm: list = []
    backend, why = choose_backend(config, features, has_gpu)
    log.info("vLLM snapshots: %s backend (%s)", backend, why)
    if backend == "vllm":
        snap = VllmSnapshotBackend.from_config(config, python=python, criu=criu)
        first.append(VllmSnapshotRestore(snap, socket=config.engine_socket, identity=identity,
                                         features=features, has_gpu=has_gpu))
    if config.vllm.preload.enabled:
        link = PreloadLink(config, gpu=lambda: engine_gpu(config))
        warm.append(VllmPreloadStart(adapter, link, features, has_gpu))
    return first, warm
