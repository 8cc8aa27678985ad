"""The standby rung: a stopped copy of the engine, restored before the crash, continued."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint import standby as sb
from agent.checkpoint.snapshotter import Snapshotter
from agent.config import Config
from agent.engines.base import EngineAdapter, LaunchSpec
from agent.engines.probe import EngineProbe
from agent.errors import EngineError, SnapshotError, StartPathError
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest
from agent.supervisor.engine import EngineProcess, Exit
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.holder import HybridRestore
from agent.supervisor.paths.restore import resume_timeout_s
from agent.supervisor.status import StandbyFacts

log = logging.getLogger("pitstop.standby")


@dataclass
class Armed:
    """A standby: the image it was restored from, the process that made its namespaces
    (its exit is the standby's), the host PID of its restored root, whether it was woken
    ahead of the crash (running, its CUDA state on the GPU and locked) or waits stopped,
    the pipe on which its init tells how the root ended (-1 once handed on), and whether it
    can serve while a dead engine's tree is still going (`apart`)."""

    manifest: Manifest
    init: EngineProcess
    root: int
    woken: bool = False
    report: int = -1
    apart: bool = False

    def close_report(self) -> None:
        if self.report >= 0:
            os.close(self.report)
            self.report = -1


def exit_of(data: bytes) -> Exit | None:
    """How the standby's root ended, from its init's last line (agent/checkpoint/nsinit.py);
    None for anything else (the init itself died: its own exit tells)."""
    try:
        msg = json.loads(data or b"{}")
    except ValueError:
        return None
    if not isinstance(msg, dict):
        return None
    if "exit_signal" in msg:
        return Exit(code=None, signal=int(msg["exit_signal"]))
    if "exit_code" in msg:
        return Exit(code=int(msg["exit_code"]), signal=None)
    return None


class StandbyRestore:
    """Continue a copy of the engine that was restored, stopped, from the newest hybrid
    snapshot while the engine it copies still served (agent/checkpoint/nsinit.py: its own
    PID, mount and network namespaces, so nothing of it clashes with the live engine); then the same
    resume as the hybrid rung (the held weights mapped again) and the canary.

    Example::

        standby = StandbyRestore(hybrid, snapshotter=snap, adapter=adapter, socket=sock,
                                 timeout_s=resume_timeout_s(config),
                                 wake_ahead=config.snapshots.standby_woken)
        standby.arm_soon()   # after each ready engine and each published snapshot
        await standby.close()  # when the agent stops
    """

    name = "standby"
    reuses_held_memory = True

    def __init__(self, hybrid: HybridRestore, *, snapshotter: Snapshotter | None,
                 adapter: EngineAdapter, socket: Path, timeout_s: float,
                 wake_ahead: bool = False,
                 apart: Callable[[], bool] = lambda: False,
                 on_change: Callable[[StandbyFacts], None] = lambda _f: None) -> None:
        # Its checks are the hybrid rung's: the same snapshot, holder and identity.
        self._hybrid = hybrid
        self._snap = snapshotter
        self._adapter = adapter
        self._socket = Path(socket)
        self.timeout_s = timeout_s
        # snapshots.standby_woken: each standby is woken as soon as it is restored (it then
        # holds its CUDA state on the GPU while it waits), so a crash costs no CUDA restore.
        self._wake_ahead = wake_ahead
        # Asked (off the loop) once a standby is armed, with the engine it follows serving:
        # whether the standby could serve beside that engine's dead tree (agent/wiring.py).
        self._apart = apart
        self.armed: Armed | None = None
        # Why there is none ("" while one is armed or being restored).
        self.why_none = "no hybrid snapshot restored as a standby yet"
        self._arming: asyncio.Task[None] | None = None
        # Asked to arm while arming: a snapshot published meanwhile may be newer than the one
        # being restored, so the newest is looked for again once this arming ends.
        self._again = False
        # Told whenever the standby is armed, used, torn down or dies (status, metrics).
        self._on_change = on_change

    def facts(self) -> StandbyFacts:
        armed = self.armed
        return StandbyFacts(armed=armed is not None,
                            snapshot=armed.manifest.id if armed is not None else "",
                            why_none=self.why_none if armed is None else "")

    def _tell(self) -> None:
        self._on_change(self.facts())

    def reconfigure(self, config: Config) -> None:
        """health.timeout_s, as a reload left it: the next resume's limit."""
        self.timeout_s = resume_timeout_s(config)

    # --- arming ---------------------------------------------------------------------------
    def arm_soon(self) -> None:
        """Restore a standby from the newest usable hybrid snapshot in the background, unless
        one of it is armed already (the previous one is torn down first)."""
        if self._snap is None:
            return
        if self._arming is not None and not self._arming.done():
            self._again = True
            return
        self._arming = asyncio.ensure_future(self._arm_and_tell())

    async def _arm_and_tell(self) -> None:
        try:
            self._again = True
            while self._again:
                self._again = False
                await self._arm()
        finally:
            self._tell()

    def _refused(self) -> Refusal | None:
        """Why no standby serves this engine (its workers), whatever snapshot there is."""
        return self._hybrid.image_refusal() or self._hybrid.one_worker_refusal(self.name)

    async def _arm(self) -> None:
        chosen = await asyncio.to_thread(
            lambda: self._refused() or self._hybrid.choose())
        if isinstance(chosen, Refusal):
            self.why_none = f"no standby: {chosen.detail}"
            await self.disarm(self.why_none)
            return
        m = chosen.plan
        if self.armed is not None and self.armed.manifest.id == m.id:
            return
        await self.disarm(f"snapshot {m.id} replaces it")
        self.why_none = f"the standby of snapshot {m.id} is being restored"
        try:
            self.armed = await self._restore(m)
        except (OSError, SnapshotError, EngineError) as e:
            self.why_none = f"the standby of snapshot {m.id} could not be restored: {e}"
            log.error("standby: %s", self.why_none)
            return
        self.why_none = ""
        self.armed.init.exited.add_done_callback(lambda _f, a=self.armed: self._died(a))
        log.info("standby armed from snapshot %s (root PID %d, %s; %s)", m.id,
                 self.armed.root, "woken, CUDA locked" if self.armed.woken else "stopped",
                 "serves beside a dead tree" if self.armed.apart
                 else "waits for a dead tree to go first")

    async def _restore(self, m: Manifest) -> Armed:
        assert self._snap is not None
        r, w = os.pipe()
        try:
            # On the event loop's thread, as every engine: it dies with that thread.
            init = EngineProcess.spawn(
                LaunchSpec(sb.init_argv(self._snap, m, self._socket, w)), pass_fds=(w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        try:
            await asyncio.to_thread(sb.read_report, r, self._snap.restore_limit_s)
            root = await asyncio.to_thread(sb.ns_root, init.pid)
            if self._wake_ahead:
                woke = await asyncio.to_thread(sb.wake_standby, self._snap, m, root,
                                               gpu_uuid=self._hybrid.host_gpu_uuid())
                log.info("standby of snapshot %s woken ahead: %s", m.id,
                         ", ".join(f"{k} {v:.3f}s" for k, v in sorted(woke.items())))
            apart = await asyncio.to_thread(self._apart)
        except BaseException:
            os.close(r)
            await init.kill()
            await init.close()
            raise
        return Armed(m, init, root, woken=self._wake_ahead, report=r, apart=apart)

    def _died(self, armed: Armed) -> None:
        armed.close_report()
        if self.armed is armed:
            self.armed = None
            self.why_none = f"the standby (PID {armed.init.pid}) died: {armed.init.exited.result()}"
            log.warning("standby: %s", self.why_none)
            self._tell()

    async def disarm(self, why: str) -> None:
        """Tear the standby down (its snapshot was replaced, the agent stops)."""
        armed, self.armed = self.armed, None
        if armed is not None:
            log.info("standby of snapshot %s torn down: %s", armed.manifest.id, why)
            self.why_none = f"torn down: {why}"
            self._tell()
            armed.close_report()
            await armed.init.kill()
            await armed.init.close()

    async def close(self) -> None:
        if self._arming is not None:
            self._arming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._arming
        await self.disarm("the agent stops")

    # --- the rung -------------------------------------------------------------------------
    def serves_beside_dead(self) -> bool:
        """Whether the armed standby can serve while the dead engine's tree is still going:
        it needs none of that tree's PIDs, sockets or files (its namespaces are its own),
        and `apart` said the GPU has room for it beside the dead engine."""
        armed = self.armed
        return armed is not None and armed.init.alive and armed.apart

    async def prepare(self, attempt: Attempt) -> Prepared[Armed] | Refusal:
        refused = self._refused()
        if refused is not None:
            return refused  # nothing is armed either
        armed = self.armed
        if armed is None or not armed.init.alive:
            return Refusal(RefusalCode.STANDBY_NOT_ARMED, self.why_none or "no standby armed")
        # The hybrid rung's checks, now: the snapshot still the newest usable one of this
        # host's identity, the holder holding the regions it was taken against.
        chosen = await asyncio.to_thread(self._hybrid.choose)
        if isinstance(chosen, Refusal):
            return chosen
        if chosen.plan.id != armed.manifest.id:
            self.arm_soon()
            return Refusal(RefusalCode.STANDBY_STALE,
                           f"the standby is of snapshot {armed.manifest.id}, the newest usable "
                           f"hybrid snapshot is {chosen.plan.id}")
        return Prepared(self.name, armed, canary=chosen.canary, stages=chosen.stages)

    def start_limit_s(self, prepared: Prepared[Armed]) -> float:
        return self.timeout_s + self._adapter.control_limit_s

    async def start(self, attempt: Attempt, prepared: Prepared[Armed]) -> EngineProcess:
        armed = prepared.plan
        # Taken: whatever happens next, it is no longer a standby.
        if self.armed is armed:
            self.armed = None
        self.why_none = "the standby was used; the next one is restored once an engine serves"
        self._tell()
        assert self._snap is not None
        try:
            with attempt.stage("standby_continue"):
                timings = await asyncio.to_thread(
                    sb.continue_standby, self._snap, armed.manifest, armed.root,
                    gpu_uuid=self._hybrid.host_gpu_uuid(), woken=armed.woken)
            self._point_socket(armed.root)
            with attempt.stage("resume"):
                async with EngineProbe(self._socket, timeout=self.timeout_s) as probe:
                    await self._adapter.resume(probe)
        except (OSError, SnapshotError, EngineError) as e:
            armed.close_report()
            await armed.init.kill()
            await armed.init.close()
            raise StartPathError(Refusal(RefusalCode.STANDBY_FAILED,
                                         f"the standby of snapshot {armed.manifest.id} "
                                         f"did not come up: {e}")) from e
        for stage, secs in timings.items():
            if stage != "standby_continue":
                attempt.stages[stage] = attempt.stages.get(stage, 0.0) + secs
        log.info("standby of snapshot %s continued as PID %d", armed.manifest.id, armed.root)
        if armed.report >= 0:
            # Its init says at once when the root dies: the engine is dead then, not once
            # every process of its namespace is gone.
            armed.init.end_with(armed.report, exit_of)
            armed.report = -1
        return armed.init

    def _point_socket(self, root: int) -> None:
        """The engine's socket path, where the front and the probes connect, made a link into
        the standby's mount namespace (the kernel resolves it, so sun_path's 108 bytes hold
        the link, not the long path): the dead engine's socket file is replaced at once."""
        link = self._socket.with_name(f".{self._socket.name}.standby")
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.symlink(f"/proc/{root}/root{self._socket}", link)
        os.replace(link, self._socket)

    async def after_verified(self, engine: EngineProcess, prepared: Prepared[Armed]) -> None:
        return None

    async def failed(self, prepared: Prepared[Armed], reason: str) -> None:
        # Not the snapshot's failure alone (the copy sat stopped a while): the hybrid rung
        # restores it next, and sets it aside if it fails there too.
        log.error("standby of snapshot %s failed: %s", prepared.plan.manifest.id, reason)
