"""Compare two identities and name every field that differs, and whether a restore remaps it."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from agent.identity import REMAPPED_FIELDS, Identity

# Stands for the GPU's UUID where the engine's arguments or environment name it
# (CUDA_VISIBLE_DEVICES=GPU-...): a GPU the restore remaps is not a difference there either.
GPU_PLACEHOLDER = "<gpu_uuid>"


@dataclass(frozen=True)
class Difference:
    """One identity field that differs between a snapshot and the host; `remapped` when the
    restore puts it right (the GPU's UUID) instead of refusing the snapshot."""

    field: str
    old: Any
    new: Any
    remapped: bool = False

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}"


def _values(ident: Identity, remapped: Collection[str]) -> dict[str, Any]:
    """The identity's fields, with the remapped GPU's UUID written as a placeholder where the
    engine's arguments and environment name it."""
    out = dict(ident)
    uuid = ident.gpu_uuid
    if "gpu_uuid" in remapped and uuid:
        out["engine_args"] = tuple(a.replace(uuid, GPU_PLACEHOLDER) for a in ident.engine_args)
        out["env"] = {k: v.replace(uuid, GPU_PLACEHOLDER) for k, v in ident.env.items()}
    return out


def classify(old: Identity, new: Identity,
             remapped: Collection[str] = REMAPPED_FIELDS) -> list[Difference]:
    """Every field where `old` (the snapshot's) and `new` (the host's) differ, each marked
    `remapped` when it is one of `remapped` (a restore puts it right); [] when equal."""
    a, b = _values(old, remapped), _values(new, remapped)
    return [
        Difference(name, getattr(old, name), getattr(new, name), name in remapped)
        for name in Identity.model_fields
        if a[name] != b[name] or (name in remapped and getattr(old, name) != getattr(new, name))
    ]


def compare(old: Identity, new: Identity,
            remapped: Collection[str] = frozenset()) -> list[Difference]:
    """The fields that refuse a restore of `old` (the snapshot's) on `new` (the host): every
    difference but those in `remapped`, which the caller's backend puts right at restore.
    With the default, every field must be equal.

    Example::

        [str(d) for d in compare(snapshot_identity, host_identity)]
        # ["kernel: '6.1.0' -> '6.18.0'"]
    """
    return [d for d in classify(old, new, remapped) if not d.remapped]


def describe(differences: list[Difference]) -> str:
    """One line naming every difference, for logs and error messages."""
    return "; ".join(str(d) for d in differences)
