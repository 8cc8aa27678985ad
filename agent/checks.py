"""One `pitstop doctor` item: what the host checks of every part (agent, engines) return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One doctor item. `needed`: a failure stops snapshots (exit 1); otherwise a warning."""

    name: str
    ok: bool
    needed: bool
    detail: str
    fix: str | None = None
