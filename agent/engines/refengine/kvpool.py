"""The KV cache: one preallocated tensor, handed out to requests slot by slot."""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

import torch

from agent.engines.refengine.model import LlamaConfig
from agent.errors import HolderError

if TYPE_CHECKING:
    from agent.engines.refengine.keptkv import HeldKV

log = logging.getLogger("refengine")


def _have_cuda_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no `cuda` package at all
        return False


class KVPool:
    """A (layers, 2, slots, kv_heads, max_len, head_dim) tensor that can be freed and rebuilt.

    Freeing it (before a snapshot) leaves the engine's image small; `allocate` brings it back.

    Example::

        pool = KVPool(config, slots=8, max_len=2048, device=torch.device("cpu"),
                      dtype=torch.float32)
        slot = pool.acquire()
        views = pool.slot_views(slot)   # per layer (K, V), each (kv_heads, max_len, head_dim)
        pool.release(slot)
    """

    def __init__(self, config: LlamaConfig, slots: int, max_len: int,
                 device: torch.device, dtype: torch.dtype, held: HeldKV | None = None) -> None:
        self.shape = (config.num_layers, 2, slots, config.num_kv_heads, max_len, config.head_dim)
        self.slots = slots
        self.max_len = max_len
        self.device = device
        self.dtype = dtype
        self._tensor: torch.Tensor | None = None
        self._free = list(range(slots - 1, -1, -1))
        self._space: Any = None
        # In the holder (--holder): the pool outlives this process, for the next engine.
        self.held = held
        # Whether the memory now mapped came back from an earlier life (kept KV).
        self.kept = False
        # On a GPU the pool lives in a VA range reserved for the life of the process: freed
        # before a checkpoint and made again at the same addresses after it, so CUDA graphs
        # captured over it stay valid (graphs.py). cuda-bindings is optional; without it
        # torch's allocator holds the pool, and graphs are captured again when it moves.
        if held is None and device.type == "cuda" and _have_cuda_bindings():
            from agent.tenant.mapping_cuda import CudaSpace, local_granularity

            index = device.index if device.index is not None else torch.cuda.current_device()
            self._space = CudaSpace(self.nbytes, local_granularity(index), index)

    @staticmethod
    def layout(config: LlamaConfig, slots: int, max_len: int, dtype: torch.dtype
               ) -> tuple[tuple[int, ...], int]:
        """The pool's shape and size in bytes."""
        shape = (config.num_layers, 2, slots, config.num_kv_heads, max_len, config.head_dim)
        n = torch.tensor([], dtype=dtype).element_size()
        for d in shape:
            n *= d
        return shape, n

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n

    @property
    def allocated(self) -> bool:
        return self._tensor is not None

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def allocate(self) -> int:
        """Make the pool tensor; returns its size in bytes (0 when it already existed)."""
        if self._tensor is not None:
            return 0
        if self.held is not None:
            # The held pool's addresses last for the process's life, like the private
            # reservation's; its bytes are not zeroed here: they are what the ledger
            # vouches for (a new region starts zeroed).
            try:
                if self.held.pool is None:
                    self.held.open()
                else:
                    self.held.reattach()
            except HolderError as e:
                # Serving matters more than keeping KV: a private pool, nothing kept.
                log.warning("kept KV off: the holder cannot hold the KV pool (%s); using a "
                            "private one", e)
                self.held = None
        if self.held is not None:
            self.kept = self.held.kept
            raw = self.held.pool_tensor()[:self.nbytes]
            self._tensor = raw.view(self.dtype).view(self.shape)
        elif self._space is not None:
            self._space.create(0, self._space.size)
            raw = self._space.tensor(0, self.nbytes)
            # Zeros on the GPU: a graph step attends over a whole span, positions not yet
            # written masked; a NaN in fresh memory would still poison 0 * V.
            self._tensor = raw.view(self.dtype).view(self.shape).zero_()
        elif self.device.type == "cuda":
            self._tensor = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        else:
            # empty, not zeros: eager attention reads only positions a request wrote, and
            # untouched CPU pages stay out of a checkpoint image.
            self._tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.nbytes

    @property
    def address(self) -> int:
        """Where the pool's memory starts (0 while freed): captured graphs point into it."""
        return 0 if self._tensor is None else self._tensor.data_ptr()

    def free(self) -> int:
        """Drop the pool tensor; returns the bytes freed. Only legal with no slot in use."""
        if self.used:
            raise RuntimeError(f"KV pool freed with {self.used} slots in use")  # invariant
        if self._tensor is None:
            return 0
        self._tensor = None
        if self.held is not None:
            self.held.detach()  # unmapped, out of any image; the holder keeps the bytes
        elif self._space is not None:
            self._space.unmap(0, self._space.size)  # back to the driver; the range is kept
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give cached memory back to the driver, not just the cache
        return self.nbytes

    def acquire(self, avoid: set[int] | frozenset[int] = frozenset()) -> int | None:
        """A free slot, one not in `avoid` (slots whose kept KV may yet be claimed) first."""
        if not self._free or self._tensor is None:
            return None
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i] not in avoid:
                return self._free.pop(i)
        return None

    def take(self, slot: int) -> bool:
        """Acquire this very slot (a resumed request's kept KV is there), if it is free."""
        if self._tensor is None or slot not in self._free:
            return False
        self._free.remove(slot)
        return True

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("KV pool used while freed")  # the scheduler never admits then
        return self._tensor

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"KV slot {slot} released twice")  # invariant
        self._free.append(slot)

    def slot_views(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._tensor is None:
            raise RuntimeError("KV pool used while freed")  # the scheduler never admits then
        t = self._tensor
        return [(t[layer, 0, slot], t[layer, 1, slot]) for layer in range(self.shape[0])]
