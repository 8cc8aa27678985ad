"""Text and JSON views of the store for `pitstop snapshot`: formatting only, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.store.manifest import Manifest
from agent.store.store import Entry, Quarantined, Verdict


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def entry_json(e: Entry) -> dict[str, Any]:
    m = e.manifest
    return {
        "id": e.id,
        "kind": m.kind if m else None,
        "created_at": m.created_at.isoformat() if m else None,
        "image_bytes": m.image_bytes if m else None,
        "bytes_on_disk": e.bytes_on_disk,
        "problem": e.problem.to_json() if e.problem else None,
        "quarantined": None,
    }


def quarantined_json(q: Quarantined) -> dict[str, Any]:
    """A quarantined snapshot, in the same shape as a published one (`quarantined` set)."""
    m = q.manifest
    return {
        "id": q.id,
        "kind": m.kind if m else None,
        "created_at": m.created_at.isoformat() if m else None,
        "image_bytes": m.image_bytes if m else None,
        "bytes_on_disk": q.bytes_on_disk,
        "problem": q.reason,
        "quarantined": {"code": q.code, "at": q.quarantined_at, "path": str(q.path)},
    }


def _table(rows: list[tuple[str, Manifest | None, int, str]], empty: str) -> str:
    if not rows:
        return empty
    lines = [f"{'ID':<34} {'KIND':<7} {'CREATED (UTC)':<20} {'SIZE':>10}  STATUS"]
    for sid, m, size, status in rows:
        created = m.created_at.strftime("%Y-%m-%d %H:%M:%S") if m else "-"
        lines.append(f"{sid:<34} {m.kind if m else '-':<7} {created:<20} {_size(size):>10}  "
                     f"{status}")
    return "\n".join(lines)


def entries_text(entries: Sequence[Entry]) -> str:
    return _table([(e.id, e.manifest, e.bytes_on_disk,
                    "ok (checksums not read; use verify)" if e.manifest
                    else f"BROKEN: {e.problem}") for e in entries], "no snapshots")


def quarantined_text(aside: Sequence[Quarantined]) -> str:
    return _table([(q.id, q.manifest, q.bytes_on_disk,
                    f"QUARANTINED ({q.code or 'no code'}): {q.reason}") for q in aside],
                  "no quarantined snapshots")


def manifest_text(m: Manifest) -> str:
    lines = [
        f"id:          {m.id}",
        f"kind:        {m.kind}",
        f"created:     {m.created_at.isoformat()}",
        f"image:       {_size(m.image_bytes)} in {len(m.files)} files",
        f"process:     root PID {m.process.root_pid}, PIDs {list(m.process.pids)}"
        + (f", CUDA in {list(m.process.cuda_pids)}" if m.process.cuda_pids else ""),
        f"criu flags:  {' '.join(m.criu_flags)}",
        "timings:     " + ", ".join(f"{k} {v:.3f}s" for k, v in m.timings.items()),
        f"canary:      {m.canary.prompt!r} -> {m.canary.text!r}",
        "identity:",
    ]
    lines += [f"  {k:<20} {v!r}" for k, v in m.identity.model_dump().items()]
    return "\n".join(lines)


def verdict_json(v: Verdict) -> dict[str, Any]:
    return {"id": v.id, "ok": v.ok, "reasons": list(v.reasons)}


def verdict_text(v: Verdict) -> str:
    if v.ok:
        return f"{v.id}: ok"
    return f"{v.id}: REFUSED\n" + "\n".join(f"  - {r}" for r in v.reasons)
