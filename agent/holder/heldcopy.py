"""A copy on disk of a committed weights set that an engine holds in its own layout.

vLLM holds its parameters, not the files' bytes: a refill from the model's files cannot
make its regions. Once such a set is committed, this writes each region's bytes into a
file of the holder's directory and returns the refill plan that loads them again (source
`copy`): the holder's refill reads it as it reads model files, with the same checks.

Run as its own process (`python -m agent.holder.heldcopy`), a tenant of the holder that
attaches the set (the regions cannot go while it holds them) and never touches a GPU the
agent's process would then hold a context on. The cpu backend only, for now: reading a
cuda backend's regions back (map, then cuMemcpyDtoH) is not written yet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from agent.errors import HolderError, ModelError
from agent.holder.client import HolderClient
from agent.holder.protocol import MemoryKind
from agent.holder.weightplan import PlanFile, PlanRegion, PlanSource, RefillPlan
from agent.weights import stat_key

# Where the copies live, under the holder's per-GPU directory (beside its plan).
COPY_DIR = "copies"
# The backend whose regions this can read back: a memfd reads like a file.
COPYABLE_BACKEND = "cpu"
PIECE = 16 << 20


def copy_file_name(region: str) -> str:
    """The file a region's copy is written to: its name, made one path component."""
    return region.replace("/", "--").replace(":", "-") + ".bin"


def copy_held(socket: Path, digest: str, directory: Path) -> RefillPlan:
    """Write the committed set of `digest` into `directory` (made private if missing);
    the plan that loads it back. HolderError when the set is not all committed, or the
    backend's memory cannot be read here; OSError when the disk cannot take it. A copy is
    written to a temporary name, fsynced and renamed: a half-written one is never named."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with HolderClient(socket) as c:
        backend = c.stats().backend
        regions = c.committed_set(digest)
        if regions is None:
            raise HolderError(f"the holder at {socket} holds no committed set of {digest}")
        if backend != COPYABLE_BACKEND and any(r.memory is MemoryKind.DEVICE for r in regions):
            raise HolderError(f"the {backend} backend's regions cannot be copied to disk yet "
                              "(only the cpu backend's)")
        files, planned = [], []
        for r in regions:
            name = copy_file_name(r.name)
            with c.attach(r.name) as grant:
                sha256 = _write(grant.fds, grant.region.chunks, r.size, directory / name)
            key = stat_key(os.stat(directory / name))
            files.append(PlanFile(name=name, size=r.size, sha256=sha256, key=key))
            planned.append(PlanRegion(name=r.name, file=name, offset=0, size=r.size))
    return RefillPlan(digest=digest, model=str(directory), files=files, regions=planned,
                      source=PlanSource.COPY)


def _write(fds: list[int], chunks: list[int], size: int, path: Path) -> str:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    h = hashlib.sha256()
    fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    try:
        with os.fdopen(fd_out, "wb") as out:
            left = size
            for fd, chunk in zip(fds, chunks, strict=True):
                at = 0
                while left and at < chunk:
                    data = os.pread(fd, min(PIECE, chunk - at, left), at)
                    if not data:
                        raise HolderError(f"a held chunk ended {at} bytes in, not {chunk}")
                    h.update(data)
                    out.write(data)
                    at += len(data)
                    left -= len(data)
            if left:
                raise HolderError(f"the held chunks hold {size - left} bytes, not {size}")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.holder.heldcopy", description=__doc__)
    ap.add_argument("--socket", type=Path, required=True, help="the holder's socket")
    ap.add_argument("--digest", required=True, help="the weights digest of the committed set")
    ap.add_argument("--out", type=Path, required=True, help="the directory to write into")
    args = ap.parse_args(argv)
    try:
        plan = copy_held(args.socket, args.digest, args.out)
    except (HolderError, ModelError, OSError) as e:
        print(f"heldcopy: {e}", file=sys.stderr)
        return 1
    json.dump(plan.model_dump(mode="json"), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
