"""Checkpoint backends (CRIU, CUDA checkpoint) and the Snapshotter that drives them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.checkpoint.snapshotter import Snapshotter
    from agent.config import Config


def build_snapshotter(config: Config) -> Snapshotter:
    """The Snapshotter for `config`: the store at paths.snapshots, CRIU found by
    criu_locate, and CUDA checkpoint (used only for processes that hold a GPU).

    Example::

        snap = build_snapshotter(load_config(path))
        snap.store.select(identity)
    """
    from agent.checkpoint.criu import CriuBackend
    from agent.checkpoint.criu_locate import locate
    from agent.checkpoint.cuda import CudaCheckpoint
    from agent.checkpoint.snapshotter import Snapshotter
    from agent.store import SnapshotStore

    store = SnapshotStore(config.paths.snapshots,
                          trust_sealed=config.snapshots.verify == "changed")
    return Snapshotter(
        store,
        CriuBackend(locate(config.snapshots.criu)),
        CudaCheckpoint(config.snapshots.cuda_lock_timeout_ms),
        restore_log_dir=config.paths.run / "criu",
        keep=config.snapshots.keep,
        budget_bytes=int(config.snapshots.disk_budget_gib * 2**30),
    )
