"""`pitstop holder status|release`: a small operator's view over the client."""

from __future__ import annotations

import json
from pathlib import Path

from agent.holder.client import HolderClient


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def holder_status(base: Path, gpu: str, as_json: bool = False) -> int:
    with HolderClient.for_gpu(base, gpu, timeout=5.0) as h:
        stats = h.stats()
        regions = h.list()
    if as_json:
        print(json.dumps({"stats": stats.model_dump(),
                          "regions": [r.model_dump() for r in regions]}, indent=1))
        return 0
    print(f"holder:   pid {stats.pid}, id {stats.holder_id}, backend {stats.backend}, "
          f"gpu {stats.gpu}")
    print(f"held:     {_mib(stats.bytes_held)} ({stats.bytes_committed} bytes committed, "
          f"{stats.bytes_pending} being written)")
    print(f"regions:  {stats.regions_committed} committed, {stats.regions_pending} being "
          f"written; {stats.sessions} sessions")
    for r in sorted(regions, key=lambda r: r.name):
        state = "committed" if r.committed else "writing"
        print(f"  {r.name}  {_mib(r.mapped_size)}  epoch {r.epoch}  {state}  "
              f"digest {r.digest[:16]}")
    return 0


def holder_release(base: Path, gpu: str, names: list[str], release_all: bool = False) -> int:
    with HolderClient.for_gpu(base, gpu, timeout=5.0) as h:
        if release_all:
            names = [r.name for r in h.list() if r.committed]
        freed = 0
        for name in names:
            freed += h.release(name).mapped_size
            print(f"released {name}")
    print(f"freed {_mib(freed)}")
    return 0
