"""What a snapshot's image will hold of this engine, made smaller just before the dump.

A hybrid image is the engine's own memory: its host pages, and everything the CUDA
checkpoint moves from the GPU into them (the CUDA context, cuBLAS workspaces, the graphs'
pool, whatever torch's caching allocator still reserves). Its restore reads every byte
back at the speed of CRIU's page reads, then the CUDA restore copies the device part back
to the GPU; so what is dropped here, before the dump, comes off both.
"""

from __future__ import annotations

import logging
from typing import Any

from agent.tenant.trim import Trimmed, give_back

log = logging.getLogger("refengine")


def shrink(cuda: bool, stack: int | None = None) -> Trimmed:
    """Give back what the engine keeps only as a cache (agent/tenant/trim.py: Python's
    garbage, torch's unused GPU blocks and cached pinned host buffers, the heap's free
    pages). Graphs keep their own pool, and cuBLAS its workspaces (their addresses are
    baked into the graphs). `stack`: the per-thread stack set to that many bytes (CUDA's
    default is 1024), so that local memory the driver keeps for a larger one is not in
    the image (the driver grows it again at the launch of a kernel that needs more)."""
    trimmed = give_back(cuda)
    if cuda and stack is not None:
        _set_stack_limit(stack)
    return trimmed


def describe(device: Any, graphs: int | None) -> dict[str, int | None]:
    """Figures for the prepare log: where the image's bytes will come from."""
    out: dict[str, int | None] = {**_rss(), "graphs": graphs}
    if getattr(device, "type", "cpu") != "cuda":
        return out
    import torch

    out["torch_reserved"] = torch.cuda.memory_reserved(device)
    out["torch_allocated"] = torch.cuda.memory_allocated(device)
    try:
        out["pinned_cached"] = int(
            torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):
        out["pinned_cached"] = None
    out["device_free"] = int(torch.cuda.mem_get_info(device)[0])
    out["stack_per_thread"] = _stack_limit()
    return out


def _stack_limit() -> int | None:
    """The context's per-thread stack size: the driver keeps local memory for it on every
    thread the GPU can hold at once (and grows it for a kernel that needs more), which is
    part of what the CUDA checkpoint moves. None without cuda-bindings."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    # The runtime API: it makes the primary context current on this (worker) thread.
    err, value = rt.cudaDeviceGetLimit(rt.cudaLimit.cudaLimitStackSize)
    return int(value) if err == rt.cudaError_t.cudaSuccess else None


def _set_stack_limit(size: int) -> None:
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        log.warning("--prepare-stack needs cuda-bindings (pip install cuda-bindings); "
                    "the stack is left as it is")
        return
    (err,) = rt.cudaDeviceSetLimit(rt.cudaLimit.cudaLimitStackSize, size)
    if err != rt.cudaError_t.cudaSuccess:
        log.warning("prepare: the per-thread stack could not be set to %d bytes: %s",
                    size, err)


def largest_mappings(n: int = 6) -> list[str]:
    """This process's `n` mappings with the most private dirty memory (what CRIU dumps of
    the host side), as "START-END SIZE_MB dirty DIRTY_MB NAME" from /proc/self/smaps."""
    found: list[tuple[int, str]] = []
    head, dirty = "", 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                key = line.split(maxsplit=1)[0]
                if "-" in key and not key.endswith(":"):  # a mapping's first line
                    if head:
                        found.append((dirty, head))
                    head, dirty = line.strip(), 0
                elif key == "Private_Dirty:":
                    dirty = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return []
    if head:
        found.append((dirty, head))
    out = []
    for d, h in sorted(found, reverse=True)[:n]:
        parts = h.split()
        lo, _, hi = parts[0].partition("-")
        size = (int(hi, 16) - int(lo, 16)) / 1e6
        name = parts[5] if len(parts) > 5 else "[anon]"
        out.append(f"{parts[0]} {size:.0f}MB dirty {d / 1e6:.0f}MB {name}")
    return out


def _rss() -> dict[str, int | None]:
    """This process's resident memory by kind (/proc/self/status, in bytes)."""
    want = {"RssAnon": "host_anon", "RssFile": "host_file", "RssShmem": "host_shmem"}
    out: dict[str, int | None] = dict.fromkeys(want.values())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in want:
                    out[want[key]] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out
