"""A tenant process for the holder tests: writes a region set, or reads one, then reports."""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
import time

import torch

from agent.holder.client import HolderClient
from agent.tenant.mapping import HeldSet, HostSpace


def pattern(seed: int, size: int) -> bytes:
    """Deterministic bytes that differ per seed."""
    block = hashlib.sha256(str(seed).encode()).digest() * 2048
    return (block * (size // len(block) + 1))[:size]


def digest_of(t: torch.Tensor) -> str:
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel())).hexdigest()


def write(sock: str, digest: str, sizes: dict[str, int], seed: int, commit: bool) -> None:
    client = HolderClient(sock)
    held = HeldSet.create(client, digest, sizes, HostSpace)
    sums = {}
    for i, name in enumerate(sorted(sizes)):
        data = pattern(seed + i, sizes[name])
        held.tensor(name).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        sums[name] = hashlib.sha256(data).hexdigest()
    if commit:
        held.commit()
    print(json.dumps({"event": "ready", "sums": sums}), flush=True)
    time.sleep(3600)  # the test kills us


def read(sock: str, digest: str) -> None:
    with HolderClient(sock) as client:
        held = HeldSet.attach(client, digest, HostSpace)
    sums = {name: digest_of(held.tensor(name)) for name in held.placements}
    print(json.dumps({"event": "read", "sums": sums}), flush=True)


if __name__ == "__main__":
    cmd, sock, digest = sys.argv[1:4]
    if cmd == "write":
        write(sock, digest, json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "commit")
    else:
        read(sock, digest)
