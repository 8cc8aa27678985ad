"""The snapshot store: manifest schema, atomic private files, publish/select/prune."""

from agent.store.manifest import Canary, ImageFile, Manifest, ProcessTree, SnapshotKind
from agent.store.store import (
    Draft,
    Entry,
    Quarantined,
    Retention,
    Selection,
    Skipped,
    SnapshotStore,
    Verdict,
)

__all__ = [
    "Canary",
    "Draft",
    "Entry",
    "ImageFile",
    "Manifest",
    "ProcessTree",
    "Quarantined",
    "Retention",
    "Selection",
    "Skipped",
    "SnapshotKind",
    "SnapshotStore",
    "Verdict",
]
