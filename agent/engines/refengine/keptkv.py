"""The KV pool and its ledger in the holder, so a dead engine's KV serves its successor."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.errors import HolderError, MappingError
from agent.holder.client import HolderClient
from agent.holder.kvledger import Ledger, LedgerShape
from agent.holder.protocol import MemoryKind
from agent.tenant.mapping import HeldSet, HostSpace

log = logging.getLogger("refengine")

# How long the holder keeps a pool no engine claims: long enough for a cold start of the
# next engine, short enough that a host that stopped serving gets its memory back.
DEFAULT_LEASE_S = 600.0
# int views of a KV element's bits, for fingerprints that are exact on every device.
_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Blocks fingerprinted per reduction: bounds the int64 copy a long context makes.
_FP_BATCH = 64


def kv_fingerprints(pool: torch.Tensor, slot: int, start: int, end: int, block: int
                    ) -> list[int]:
    """One fingerprint per `block` positions of [start, end) of `slot`, over every layer's
    K and V (the last block may be shorter). An exact function of the bits (integer sums),
    so the same KV gives the same value on any device and any run: it catches KV that was
    overwritten, not an adversary."""
    out: list[int] = []
    at = start
    while at < end:
        stop = min(end, at + block * _FP_BATCH)
        x = pool[:, :, slot, :, at:stop, :]
        x = x.view(_INT_OF[x.element_size()]).to(torch.int64)
        n = stop - at
        full, rest = divmod(n, block)
        parts = []
        if full:
            b = x[:, :, :, :full * block, :].unflatten(3, (full, block))
            s1 = b.sum(dim=(0, 1, 2, 4, 5))
            s2 = (b * b).sum(dim=(0, 1, 2, 4, 5))
            parts.append(s1 * 1_000_003 + s2)
        if rest:
            b = x[:, :, :, full * block:, :]
            parts.append((b.sum() * 1_000_003 + (b * b).sum()).view(1))
        out += torch.cat(parts).tolist()
        at = stop
    return out


def layout_digest(weights_digest: str, shape: tuple[int, ...], dtype: torch.dtype,
                  ledger: LedgerShape, owner: str = "") -> str:
    """Names what the pool's bytes mean: KV of other weights or another layout is never
    read as this engine's. `owner` keeps the pools of two agents' engines on one holder (a
    node of several engines) apart; "": any engine of these weights and this layout."""
    what = f"{weights_digest}|{shape}|{dtype}|{ledger}".encode()
    if owner:
        what += f"|{owner}".encode()
    return hashlib.blake2b(what, digest_size=16).hexdigest()


@dataclass
class HeldKV:
    """The KV pool (device memory) and its ledger (host memory) as holder regions.

    Both are leased: the holder keeps them while this process lives (another engine's
    attach is `busy` meanwhile) and for the lease after it dies, for the next engine.
    `detach` (before a checkpoint) unmaps both; `reattach` maps the same regions at the
    same addresses again, or new ones when those are gone.

    Example::

        kv = HeldKV(sock, layout, pool_bytes, ledger_shape, torch.device("cpu"))
        kv.open()                       # attach what a dead engine left, or create
        kv.pool_bytes_tensor(), kv.ledger, kv.kept
        kv.detach(); kv.reattach()
    """

    socket: Path
    layout: str
    pool_bytes: int
    ledger_shape: LedgerShape
    device: torch.device
    lease_s: float = DEFAULT_LEASE_S
    pool: HeldSet | None = None
    ledger_set: HeldSet | None = None
    ledger: Ledger | None = None
    # Whether what is mapped was left by an earlier engine (so its ledger may hold work).
    kept: bool = False

    @property
    def pool_digest(self) -> str:
        return f"kv-{self.layout}"

    @property
    def ledger_digest(self) -> str:
        return f"kvledger-{self.layout}"

    def _names(self) -> tuple[str, str]:
        return f"kv/{self.layout}/pool", f"kv/{self.layout}/ledger"

    def _device_space(self) -> Any:
        if self.device.type == "cuda":
            from agent.tenant.mapping_cuda import cuda_space_factory

            index = self.device.index if self.device.index is not None \
                else torch.cuda.current_device()
            return cuda_space_factory(index)
        return HostSpace

    def open(self) -> None:
        """Attach the regions an earlier engine left, or create them (empty ledger)."""
        with HolderClient(self.socket) as client:
            if client.has_committed(self.pool_digest) and client.has_committed(self.ledger_digest):
                self.pool = HeldSet.attach(client, self.pool_digest, self._device_space())
                try:
                    self.ledger_set = HeldSet.attach(client, self.ledger_digest, HostSpace)
                except BaseException:
                    self.pool.close()
                    raise
                self.kept = True
            else:
                self._create(client)
        self._bind_ledger()

    def _create(self, client: HolderClient) -> None:
        pool_name, ledger_name = self._names()
        self.pool = HeldSet.create(client, self.pool_digest, {pool_name: self.pool_bytes},
                                   self._device_space(), lease_s=self.lease_s)
        try:
            self.ledger_set = HeldSet.create(client, self.ledger_digest,
                                             {ledger_name: self.ledger_shape.nbytes},
                                             HostSpace, memory=MemoryKind.HOST,
                                             lease_s=self.lease_s)
        except BaseException:
            self.pool.close()
            raise
        if self.device.type == "cuda":
            # A graph step attends over a whole span, unwritten positions masked; a NaN
            # in fresh device memory would still poison 0 * V. (memfds start zeroed.)
            self.pool.tensor(pool_name).zero_()
        self.pool.commit()
        self.ledger_set.commit()
        self.kept = False

    def _bind_ledger(self) -> None:
        assert self.ledger_set is not None
        t = self.ledger_set.tensor(self._names()[1])
        self.ledger = Ledger(memoryview(t.numpy()), self.ledger_shape)

    def pool_tensor(self) -> torch.Tensor:
        """The pool's bytes (uint8, on the engine's device); valid while attached."""
        assert self.pool is not None
        return self.pool.tensor(self._names()[0])

    @property
    def attached(self) -> bool:
        return self.pool is not None and self.pool.attached

    def detach(self) -> None:
        """Unmap both regions (the ranges stay reserved) and give up the claim."""
        if self.pool is not None:
            self.pool.detach()
        if self.ledger_set is not None:
            self.ledger_set.detach()
        self.ledger = None

    def reattach(self) -> bool:
        """Map the regions again; True when the same ones came back at the same addresses.
        When they are gone (a restarted holder, a GPU fault's drop, an expired lease) new
        ones are made, at other addresses: the caller drops what pointed into the old."""
        assert self.pool is not None and self.ledger_set is not None
        try:
            with HolderClient(self.socket) as client:
                self.pool.reattach(client)
                self.ledger_set.reattach(client)
        except (HolderError, MappingError) as e:
            log.warning("kept KV: the held pool cannot be re-attached (%s); making a new one",
                        e)
            self.pool.detach()
            self.ledger_set.detach()
            self.pool.close()
            self.ledger_set.close()
            self.pool = self.ledger_set = None
            self.open()
            return False
        self.kept = True
        self._bind_ledger()
        return True

    def identity(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for s in (self.pool, self.ledger_set):
            if s is not None:
                out.update(s.identity)
        return out
