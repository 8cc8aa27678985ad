"""Checkpoint backends (backend.py: the interface; CRIU + CUDA: the Snapshotter) and the store's
construction from the configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.checkpoint.snapshotter import Snapshotter
    from agent.config import Config
    from agent.store import SnapshotStore


def build_store(config: Config) -> SnapshotStore:
    """The store at paths.snapshots with the configuration's verify and retention keys.

    Example::

        store = build_store(load_config(path))
        store.quarantined()
    """
    from agent.store import Retention, SnapshotStore

    return SnapshotStore(config.paths.snapshots,
                         trust_sealed=config.snapshots.verify == "changed",
                         retention=Retention.of(config.snapshots))


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

    return Snapshotter(
        build_store(config),
        CriuBackend(locate(config.snapshots.criu),
                    restore_verbosity=config.snapshots.restore_log_level),
        CudaCheckpoint(config.snapshots.cuda_lock_timeout_ms),
        restore_log_dir=config.paths.run / "criu",
    )
