"""Compare two identities and name every field that differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.identity import Identity


@dataclass(frozen=True)
class Difference:
    """One identity field that differs between a snapshot and the host."""

    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}"


def compare(old: Identity, new: Identity) -> list[Difference]:
    """Every field where `old` (the snapshot's) and `new` (the host's) differ; [] when equal.

    Example::

        [str(d) for d in compare(snapshot_identity, host_identity)]
        # ["kernel: '6.1.0' -> '6.18.0'"]
    """
    return [
        Difference(name, getattr(old, name), getattr(new, name))
        for name in Identity.model_fields
        if getattr(old, name) != getattr(new, name)
    ]


def describe(differences: list[Difference]) -> str:
    """One line naming every difference, for logs and error messages."""
    return "; ".join(str(d) for d in differences)
