"""Safetensors weights kept in the holder: load once into held regions, attach afterwards."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import ModelError
from agent.holder.client import HolderClient
from agent.holder.weightplan import (
    DTYPES,
    TensorEntry,
    WeightFile,
    region_name,
    weight_regions,
)
from agent.tenant.mapping import HeldSet, HostSpace, Space

# Kept importable from here: tenants name them through this module.
__all__ = ["HeldWeights", "TensorEntry", "WeightFile", "region_name"]

log = logging.getLogger("pitstop.tenant.weights")

# Staging buffer for copies from disk to the GPU.
_STAGE = 64 << 20


class HeldWeights:
    """The weights of one model, living in the holder and mapped into this process.

    Example::

        hw = HeldWeights.open(Path(sock), files, digest, device=torch.device("cpu"))
        hw.tensors["lm_head.weight"]     # a view over held memory, in the file's dtype
        hw.detach()                      # before a checkpoint (prepare)
        hw.reattach()                    # after the restore (resume)
    """

    def __init__(self, socket: Path, digest: str, files: list[WeightFile], held: HeldSet,
                 source: str, device: Any) -> None:
        self.socket = socket
        self.digest = digest
        self.files = files
        self.held = held
        self.source = source  # "holder": attached (a warm start); "disk": loaded, committed
        self.device = device
        self.tensors = self._views()

    @classmethod
    def open(cls, socket: Path, paths: list[Path], digest: str, device: Any) -> HeldWeights:
        """Attach the committed set of `digest`, or load it from disk and commit it."""
        files = [WeightFile.read_header(p) for p in sorted(paths)]
        files = [f for f in files if f.data_size > 0]
        regions = weight_regions(digest, files)
        make_space = _space_factory(device)
        with HolderClient(socket) as client:
            if client.has_committed(digest):
                held = HeldSet.attach(client, digest, make_space, by_digest=True)
                log.info("attached %d held regions of %s (%.1f MB): no weights read from disk",
                         len(files), digest, held.space.size / 1e6)
                return cls(socket, digest, files, held, "holder", device)
            sizes = {r.name: r.size for r in regions}
            held = HeldSet.create(client, digest, sizes, make_space, by_digest=True)
            try:
                for f in files:
                    _fill(held.tensor(region_name(digest, f.path)), f, device)
                held.commit()
            except BaseException:
                held.close()  # our session closes too: the holder frees the regions
                raise
            log.info("loaded %d weight files of %s into the holder and committed them",
                     len(files), digest)
            return cls(socket, digest, files, held, "disk", device)

    def _views(self) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        for f in self.files:
            region = self.held.tensor(region_name(self.digest, f.path))
            for name, e in f.tensors.items():
                dtype = getattr(torch, DTYPES[e.dtype])
                raw = region[e.begin:e.end]
                if e.begin % dtype.itemsize:
                    raise ModelError(f"{f.path}: tensor {name} starts at byte {e.begin}, not "
                                     f"aligned for {e.dtype}; it cannot be viewed in place")
                out[name] = raw.view(dtype).view(e.shape)
        return out

    @property
    def identity(self) -> dict[str, dict[str, object]]:
        return self.held.identity

    @property
    def attached(self) -> bool:
        return self.held.attached

    @property
    def nbytes(self) -> int:
        return self.held.space.size

    def detach(self) -> None:
        """Unmap the weights (keep the address range); no tensor may be read until reattach."""
        self.held.detach()

    def reattach(self) -> None:
        """Map the same regions at the same addresses; MappingError when they changed."""
        with HolderClient(self.socket) as client:
            self.held.reattach(client)


def _space_factory(device: Any) -> Callable[[int, int], Space]:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        from agent.tenant.mapping_cuda import cuda_space_factory

        return cuda_space_factory(device.index if device.index is not None
                                  else torch.cuda.current_device())
    return HostSpace


def _fill(region: Any, f: WeightFile, device: Any) -> None:
    """Copy the file's data section into the region: straight into host memory, or through
    a pinned staging buffer to the GPU."""
    import ctypes

    import torch

    with f.path.open("rb", buffering=0) as src:
        src.seek(f.data_offset)
        if region.device.type == "cpu":
            dst = (ctypes.c_uint8 * f.data_size).from_address(region.data_ptr())
            view = memoryview(dst).cast("B")
            done = 0
            while done < f.data_size:
                n = src.readinto(view[done:])
                if not n:
                    raise ModelError(f"{f.path}: ended {f.data_size - done} bytes early")
                done += n
            return
        stage = torch.empty(min(_STAGE, f.data_size), dtype=torch.uint8, pin_memory=True)
        done = 0
        while done < f.data_size:
            n = min(stage.numel(), f.data_size - done)
            buf = (ctypes.c_uint8 * n).from_address(stage.data_ptr())
            got = src.readinto(memoryview(buf).cast("B"))
            if not got:
                raise ModelError(f"{f.path}: ended {f.data_size - done} bytes early")
            region[done:done + got].copy_(stage[:got], non_blocking=False)
            done += got
