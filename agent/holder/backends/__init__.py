"""Allocator backends of the holder (cpu: memfd; cuda: CUDA VMM) behind one interface."""

from __future__ import annotations

# The interface lives in .base so that the backends built below import it without
# importing this package back (no import cycles in agent/).
from agent.holder.backends.base import Allocation, Backend, BackendError, GpuFaultError

__all__ = ["Allocation", "Backend", "BackendError", "GpuFaultError", "make_backend"]


def make_backend(kind: str, gpu: str) -> Backend:
    """The backend for `kind` ('cpu' or 'cuda'); cuda imports its bindings only here."""
    if kind == "cpu":
        from agent.holder.backends.cpu import CpuBackend

        return CpuBackend(gpu)
    if kind == "cuda":
        from agent.holder.backends.cuda import CudaBackend

        return CudaBackend(gpu)
    raise ValueError(f"unknown holder backend {kind!r}; use 'cpu' or 'cuda'")
