"""The TCP connections of a process tree, and the CRIU network lock a dump of it may use."""

from __future__ import annotations

import enum
import ipaddress
import os
import shutil
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import SnapshotError

# /proc/net/tcp states (include/net/tcp_states.h): a listener has no peer to keep in step.
_LISTEN = 0x0A


class NetworkLock(enum.Enum):
    """What CRIU does to keep TCP peers quiet while the tree is frozen (`--network-lock`)."""

    # Nothing: sound only when both ends of every connection are frozen in the same tree.
    SKIP = "skip"
    # nftables rules drop the connections' packets; needs `nft` and a CRIU built with it.
    NFTABLES = "nftables"


@dataclass(frozen=True)
class TcpConnection:
    """One TCP socket of the tree that has a peer (not a listener)."""

    pid: int
    comm: str
    local: str
    peer: str

    def __str__(self) -> str:
        return f"PID {self.pid} ({self.comm}) {self.local} -> {self.peer}"


class ExternalConnectionError(SnapshotError):
    """The tree holds a TCP connection to a peer outside it, which a snapshot cannot keep."""

    def __init__(self, message: str, connections: tuple[TcpConnection, ...]) -> None:
        super().__init__(message)
        self.connections = connections


def _endpoint(family: int, raw: str) -> tuple[str, int]:
    # The kernel prints the address as host-order 32-bit words: one for IPv4, four for IPv6.
    address, _, port = raw.partition(":")
    words = [int(address[i:i + 8], 16) for i in range(0, len(address), 8)]
    packed = struct.pack(f"<{len(words)}I", *words)
    return socket.inet_ntop(family, packed), int(port, 16)


def _show(family: int, host: str, port: int) -> str:
    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


def _key(host: str, port: int) -> tuple[str, int]:
    # A dual-stack socket sees an IPv4 peer as ::ffff:a.b.c.d; the peer's own row says a.b.c.d.
    ip = ipaddress.ip_address(host)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip), port


def _socket_owners(pids: Iterable[int], proc_root: Path) -> dict[int, int]:
    """Socket inode -> the first tree PID holding it."""
    owners: dict[int, int] = {}
    for pid in pids:
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owners.setdefault(int(target[8:-1]), pid)
    return owners


def tree_connections(pids: tuple[int, ...], proc_root: Path = Path("/proc")) -> tuple[
        tuple[TcpConnection, ...], tuple[TcpConnection, ...]]:
    """(internal, external): the tree's TCP connections whose peer is, or is not, a socket of
    the same tree. Read from the root's network namespace tables in /proc."""
    if not pids:
        return (), ()
    owners = _socket_owners(pids, proc_root)
    rows: list[tuple[int, tuple[str, int], tuple[str, int], int]] = []
    for family, table in ((socket.AF_INET, "tcp"), (socket.AF_INET6, "tcp6")):
        try:
            lines = (proc_root / str(pids[0]) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            inode, state = int(f[9]), int(f[3], 16)
            if inode in owners and state != _LISTEN:
                rows.append((family, _endpoint(family, f[1]), _endpoint(family, f[2]), inode))
    ends = {_key(*local) for _, local, _, _ in rows}
    internal, external = [], []
    for fam, local, peer, inode in rows:
        pid = owners[inode]
        try:
            comm = (proc_root / str(pid) / "comm").read_text().strip()
        except OSError:
            comm = "?"
        conn = TcpConnection(pid, comm, _show(fam, *local), _show(fam, *peer))
        (internal if _key(*peer) in ends else external).append(conn)
    return tuple(internal), tuple(external)


def choose_lock(pids: tuple[int, ...], *, leave_running: bool,
                proc_root: Path = Path("/proc"),
                nft: str | None = None) -> tuple[bool, NetworkLock]:
    """(tcp_established, lock) for a dump of `pids`; ExternalConnectionError when no lock can
    make it sound.

    With every connection inside the tree both ends freeze and restore together, so no lock
    is needed (`skip`; CRIU's default, iptables, is often not installed). A connection to
    outside the tree survives a dump only if its peer is kept quiet until the restore
    (nftables), which is possible only when the dump stops the tree: a tree left running
    goes on talking to the peer, and a later restore of the old sequence numbers would be
    reset by it."""
    internal, external = tree_connections(pids, proc_root)
    if not external:
        return bool(internal), NetworkLock.SKIP
    named = "; ".join(map(str, external[:5])) + (
        f" (+{len(external) - 5} more)" if len(external) > 5 else "")
    if leave_running:
        raise ExternalConnectionError(
            f"the engine holds a TCP connection to outside its process tree: {named}; a "
            "snapshot of a running engine cannot keep it (the peer would reset the restored "
            "connection): close it before the snapshot, or take the snapshot when it is gone",
            external)
    if (nft or shutil.which("nft", path="/usr/sbin:/sbin:/usr/bin:/bin")) is None:
        raise ExternalConnectionError(
            f"the engine holds a TCP connection to outside its process tree: {named}; "
            "keeping it needs CRIU's nftables network lock and `nft` is not installed "
            "(apt-get install nftables)", external)
    return True, NetworkLock.NFTABLES
