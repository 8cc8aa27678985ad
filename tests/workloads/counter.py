"""A tiny server for CRIU tests: a counter over a Unix socket; each count is also printed."""

import mmap
import os
import sys

from serve import serve

path, ballast_mib = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
# Memory with content, so that an image has a known, incompressible size.
ballast = os.urandom(ballast_mib << 20)
count = 0
# --cuda MIB: also hold MIB of GPU memory, whose sum is in every answer (bench/ GPU smoke).
gpu = None
if "--cuda" in sys.argv:
    import torch

    gpu = torch.ones(int(sys.argv[sys.argv.index("--cuda") + 1]) << 18, device="cuda")
# A regular file held open, as engines hold their weights.
held = open(__file__, "rb")  # noqa: SIM115
# --shapes DIR: two private mappings of files made there, whose written pages lie in known
# ways: `sparse`, one page every 4 MiB of 64 MiB (16 pages, no two in one 2 MiB window);
# `dense`, 8 MiB written whole.
shapes = []
if "--shapes" in sys.argv:
    where = sys.argv[sys.argv.index("--shapes") + 1]
    for name, size, step in (("sparse", 64 << 20, 4 << 20), ("dense", 8 << 20, mmap.PAGESIZE)):
        with open(os.path.join(where, name), "wb+") as f:
            f.truncate(size)
            m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE)
        for at in range(0, size, step):
            m[at] = 1
        shapes.append(m)


def answer(message: bytes) -> bytes | None:
    global count
    if not message.startswith(b"inc"):
        return None
    count += 1
    print(f"count {count}", flush=True)
    extra = f" {float(gpu.sum().item())}" if gpu is not None else ""
    return f"{count} {len(ballast)}{extra}\n".encode()


serve(path, answer)
