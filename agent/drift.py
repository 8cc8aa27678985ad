"""Compare two identities and name every field that differs, and whether a restore remaps it."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
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

    def brief(self) -> str:
        """As str(), but of two sequences (the engine's argument lists) only the elements
        that differ, each at its index in the old one: one changed interpreter path in a
        long argv reads as that path, not as both whole lists."""
        if not (isinstance(self.old, list | tuple) and isinstance(self.new, list | tuple)):
            return str(self)
        return f"{self.field}: {_elements(self.old, self.new)}"


def _elements(old: Sequence[Any], new: Sequence[Any]) -> str:
    changes = []
    for op, i1, i2, j1, j2 in SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        was, now = " ".join(map(repr, old[i1:i2])), " ".join(map(repr, new[j1:j2]))
        if op == "replace":
            changes.append(f"[{i1}] {was} -> {now}")
        elif op == "delete":
            changes.append(f"[{i1}] {was} removed")
        elif op == "insert":
            changes.append(f"[{i1}] {now} added")
    return ", ".join(changes)


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


def describe(differences: list[Difference], *, brief: bool = False) -> str:
    """One line naming every difference, for logs and error messages; `brief`: of an
    argument list only the elements that differ (Difference.brief)."""
    return "; ".join(d.brief() if brief else str(d) for d in differences)
