"""What the suite's killed vLLM trees leave in /dev/shm, removed when the run ends.

A vLLM killed by a test (its engine core and workers talk through `psm_*` ring buffers, and
the CPU build's tensor-parallel workers through `vllm_dist_*-cpushm_N` segments of 4 MiB)
loses its resource tracker with it; the agent removes such files after the next engine is
ready, but a test that kills a tree and starts no other leaves them, in RAM, to every later
run on the same machine (455 `psm_*` files, 15 GB, once ran a machine out of memory mid-run;
each run left two `cpushm` segments). At the end of a run, with no test left running, each
such file made during the run that no process maps or holds open is removed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM = Path("/dev/shm")
# vLLM's shared-memory files: its message queues' ring buffers, and the CPU build's
# tensor-parallel segments (named for the distributed init's FileStore).
VLLMS = ("psm_", "vllm_dist_")


def names(shm: Path = SHM) -> set[str]:
    with contextlib.suppress(OSError):
        return {n for n in os.listdir(shm) if n.startswith(VLLMS)}
    return set()


def in_use(shm: Path = SHM, proc: Path = Path("/proc")) -> set[str]:
    """The files directly in `shm` that some process maps or holds open."""
    top, used = f"{shm}/", set()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in Path(entry.path, "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith(top):
                    used.add(path[len(top):].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.scandir(Path(entry.path, "fd")):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith(top):
                        used.add(target[len(top):])
    return used


def remove_leftovers(before: set[str], shm: Path = SHM) -> list[str]:
    """Remove what the run made in `shm` (not in `before`) and nobody uses; their names."""
    doomed = sorted(names(shm) - before - in_use(shm))
    for name in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm / name)
    return doomed
