"""The agent's status: kept by the supervisor, read by metrics and `pitstop status`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.errors import StatusError
from agent.fsutil import write_private
from agent.recovery import Fall
from agent.refusal import Refusal
from agent.reload import ReloadResult
from agent.store.remote import Transfer
from agent.supervisor.states import State

log = logging.getLogger("pitstop.status")


@dataclass(frozen=True)
class Fallthrough:
    """One rung passed over in a walk of the ladder: which, how, and its typed refusal.

    Example::

        f = Fallthrough("full", Fall.SKIPPED, Refusal(RefusalCode.NO_SNAPSHOT, "no snapshot yet"))
        str(f)  # 'full skipped: no snapshot yet'
    """

    path: str
    kind: Fall
    refusal: Refusal

    def __str__(self) -> str:
        return f"{self.path} {self.kind.replace('_', ' ')}: {self.refusal.detail}"


@dataclass
class Recovery:
    """How the last (re)start went."""

    path: str
    cause: str
    result: str
    duration_s: float
    at: float
    stages: dict[str, float] = field(default_factory=dict)
    # In `pitstop status` JSON: {"path", "kind", "refusal": {"code", "detail"}} each.
    fallthroughs: list[Fallthrough] = field(default_factory=list)
    # The GPU fault that made this walk skip every rung reusing held memory; "" for none.
    gpu_fault: str = ""
    # GPU memory in use at its peak during the walk (every process); None without a GPU.
    gpu_peak_bytes: int | None = None
    # When the agent saw the engine this walk replaced fail (wall clock: its exit, or the
    # verdict of a hang); None for a walk that replaced no failed engine.
    down_at: float | None = None
    # What passed between down_at and this walk's first stage (not in duration_s):
    # `teardown` (the dead tree killed, waited for, its IDs free; the GPU read beside it)
    # and `backoff` (restart.backoff_*), in seconds.
    lead_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NewestSnapshot:
    """The newest snapshot with a readable manifest, as the store listed it last."""

    id: str
    kind: str
    created: float
    bytes_on_disk: int


@dataclass(frozen=True)
class HolderFacts:
    """What the holder answered at its last poll."""

    up: bool
    bytes_held: int | None = None
    # Starts go without the holder: the last one over it failed (HolderLink.start_failed).
    bypassed: bool = False


@dataclass(frozen=True)
class StandbyFacts:
    """The standby (snapshots.standby): armed or not, of which snapshot, and why none."""

    armed: bool
    snapshot: str = ""
    # Why none is armed ("" while one is).
    why_none: str = ""


@dataclass(frozen=True)
class PortAccess:
    """How a public port is protected; never a key, a password or a hash."""

    tls: bool = False
    # Every client must present a certificate the port verifies (mutual TLS).
    client_certificates: bool = False
    # API keys (the front) or basic-auth users (the metrics endpoint) in effect.
    credentials: int = 0


@dataclass
class AgentStatus:
    """Everything `pitstop status` prints, persisted to `status.json` on every change."""

    agent_pid: int = field(default_factory=os.getpid)
    # The engine's name on a node of several (pitstop-agent@NAME); "" for the node's one agent.
    engine: str = ""
    state: str = State.STOPPED.value
    state_since: float = field(default_factory=time.time)
    reason: str = ""
    engine_kind: str = ""
    # The engine's distribution and version, from its interpreter's package metadata.
    engine_distribution: str = ""
    engine_version: str = ""
    engine_pid: int | None = None
    engine_ready_since: float | None = None
    front: str = ""
    metrics: str = ""
    # How each is protected, as read at start and at the last reload; None while off.
    front_access: PortAccess | None = None
    metrics_access: PortAccess | None = None
    restarts: int = 0
    last_recovery: Recovery | None = None
    # Why the last snapshot attempt failed; "" when it succeeded or none was tried.
    snapshot_error: str = ""
    # The last recovery's peak GPU memory in use, by the path it ended on.
    gpu_peak_bytes: dict[str, int] = field(default_factory=dict)
    # The engine's GPU as NVML last saw it (a Verdict); "" without a GPU watch.
    gpu: str = ""
    # From the status view's last read of the store and poll of the holder (off the loop);
    # None until the first one, or without snapshots / a holder.
    newest_snapshot: NewestSnapshot | None = None
    holder: HolderFacts | None = None
    # What the last reload (SIGHUP or `pitstop reload`) applied and refused.
    last_reload: ReloadResult | None = None
    # The last pull from and push to the remote store (snapshots.remote): which snapshot,
    # how it ended (`result`: ok or a refusal code) and why, bytes and seconds.
    last_pull: Transfer | None = None
    last_push: Transfer | None = None
    # The standby, with snapshots.standby on; None while it is off.
    standby: StandbyFacts | None = None

    def to_json(self) -> dict:
        return asdict(self)


class StatusFile:
    """`status.json` in the agent's run directory, written whole (a reader sees the old
    file or the new one) and, from the agent, off the event loop.

    Example::

        status_file.post(status)      # on the loop: a worker thread writes it
        await status_file.flushed()   # everything posted is on disk
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # The newest status posted and not yet written, and the task writing them.
        self._pending: bytes | None = None
        self._writing: asyncio.Task[None] | None = None

    def write(self, status: AgentStatus) -> None:
        """Write `status` now; blocking."""
        self._write(_render(status))

    def post(self, status: AgentStatus) -> None:
        """Have `status` written soon by a worker thread; on the event loop it is only
        serialized. Of several posted meanwhile, the newest is the one written."""
        self._pending = _render(status)
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self._write_pending())

    async def flushed(self) -> None:
        """Return once everything posted so far is written (or failed to be)."""
        while self._writing is not None and not self._writing.done():
            await asyncio.shield(self._writing)

    async def _write_pending(self) -> None:
        while (data := self._pending) is not None:
            self._pending = None
            try:
                await asyncio.to_thread(self._write, data)
            except OSError as e:
                log.warning("cannot write %s: %s", self.path, e)

    def _write(self, data: bytes) -> None:
        # No fsync: the file means nothing after a reboot (`read` checks that its agent
        # runs), and each one would wait on a disk a snapshot may be filling.
        write_private(self.path, data, durable=False)

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise StatusError(
                f"no agent status at {self.path}: is the agent running with this config?"
            ) from None
        except (OSError, ValueError) as e:
            raise StatusError(f"cannot read the agent status {self.path}: {e}") from e
        pid = data.get("agent_pid")
        if not isinstance(pid, int) or not Path(f"/proc/{pid}").exists():
            data["state"] = "not running"
            data["engine_pid"] = None
        return data


def _render(status: AgentStatus) -> bytes:
    return json.dumps(status.to_json(), indent=1).encode()
