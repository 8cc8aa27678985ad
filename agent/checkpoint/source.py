"""Whose snapshots this agent restores, lists and watches: Pitstop's, vLLM's, or none and why."""

from __future__ import annotations

from enum import StrEnum


class SnapshotSource(StrEnum):
    """Where the agent's snapshots come from, a case of its own for each reason there are none.

    Example::

        source = SnapshotSource.of(enabled=cfg.snapshots.enabled, criu_ready=snap is not None,
                                   vllm=bool(vllm_first))
        if source.in_store: ...  # list them, export their metrics, watch them for drift
    """

    # Pitstop's CRIU backend takes them (kinds full and hybrid) and restores them.
    PITSTOP = "pitstop"
    # vLLM's own `vllm snapshot` (kind vllm, snapshots.backend): `pitstop vllm-snapshot
    # create` takes them, the vllm-snapshot rung restores them; the agent takes none.
    VLLM = "vllm"
    # snapshots.enabled: false.
    DISABLED = "disabled"
    # Pitstop's backend cannot run here (no usable CRIU, a store it may not use).
    UNAVAILABLE = "unavailable"

    @classmethod
    def of(cls, *, enabled: bool, criu_ready: bool, vllm: bool) -> SnapshotSource:
        """`vllm`: the configuration chose vLLM's snapshots (they replace Pitstop's own)."""
        if vllm:
            return cls.VLLM
        if criu_ready:
            return cls.PITSTOP
        return cls.UNAVAILABLE if enabled else cls.DISABLED

    @property
    def in_store(self) -> bool:
        """Whether snapshots of this agent's land in its store: listed by `pitstop status`,
        exported as `pitstop_snapshot_*` and compared with the host by the drift watcher."""
        return self in (SnapshotSource.PITSTOP, SnapshotSource.VLLM)
