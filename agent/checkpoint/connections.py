"""The connections of a process tree whose other end is outside it: what a dump cannot take."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from agent.errors import OpenConnectionsError

# linux/sock_diag.h, linux/unix_diag.h, linux/netlink.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME, UDIAG_SHOW_PEER, UDIAG_SHOW_ICONS = 0x1, 0x4, 0x8
UNIX_DIAG_NAME, UNIX_DIAG_PEER, UNIX_DIAG_ICONS = 0, 2, 3
_NLMSG = struct.Struct("=IHHII")           # len, type, flags, seq, pid
_UNIX_REQ = struct.Struct("=BBHIIIII")      # family, protocol, pad, states, ino, show, cookie
_UNIX_MSG = struct.Struct("=BBBBIII")       # family, type, state, pad, ino, cookie
_NLATTR = struct.Struct("=HH")              # len, type
_TCP_LISTEN_STATE = 10                      # TCP_LISTEN, also a listening Unix socket's state
_TCP_CLOSE_STATE = 7

# include/net/tcp_states.h, the `st` column of /proc/net/tcp
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
              6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
              11: "CLOSING"}
# A connection waiting in a listener's accept queue has no inode until accept() takes it.
_PENDING_TCP = (1, 3)

# How long a connection that its holder is closing (a front dropping its pool, a probe
# whose close is still queued on the event loop) is given to go before it counts.
SETTLE_S = 1.0

_T = TypeVar("_T")


class Outside(StrEnum):
    """Why one connection of the tree stops a dump."""

    # A connected Unix stream or seqpacket socket whose peer no process of the tree holds.
    # CRIU (criu/sk-unix.c) cannot restore half of such a pair: "Can't dump half of stream
    # unix connection", even with --ext-unix-sk, which covers datagram peers only.
    UNIX_PEER = "unix_peer"
    # A connected Unix datagram socket whose peer outside has no name: --ext-unix-sk
    # reconnects external datagram sockets by name, so CRIU refuses a nameless one.
    UNIX_DGRAM_UNNAMED = "unix_dgram_unnamed"
    # A client from outside that connected to a listener of the tree and was not accepted
    # yet: its connection exists only in the listener's queue, which CRIU cannot restore.
    UNIX_PENDING = "unix_pending"
    # A TCP connection whose remote end is no socket of the tree. Restoring it needs the
    # peer frozen as well (or a network lock that holds it back); a loopback pair inside
    # the tree is dumped together, which is what makes `--network-lock skip` sound.
    TCP_PEER = "tcp_peer"
    # A TCP connection from outside queued on a listener of the tree, not accepted yet.
    TCP_PENDING = "tcp_pending"


@dataclass(frozen=True)
class Holder:
    """A process that has a socket open, and on which fd."""

    pid: int
    command: str
    fd: int

    def __str__(self) -> str:
        return f"PID {self.pid} ({self.command}) fd {self.fd}"


@dataclass(frozen=True)
class OutsideConnection:
    """One connection of the tree whose other end is outside it.

    Example::

        c.reason is Outside.UNIX_PEER; c.inode, c.local, c.peer, c.holder.pid
    """

    reason: Outside
    inode: int
    local: str
    peer: str
    holder: Holder
    peer_inode: int = 0
    state: str = ""
    # The processes holding the other end, when one could be found (outside the tree).
    peer_holders: tuple[Holder, ...] = ()

    def __str__(self) -> str:
        where = "; held outside by " + ", ".join(map(str, self.peer_holders)) \
            if self.peer_holders else ""
        ino = f" (inode {self.peer_inode})" if self.peer_inode else ""
        state = f" {self.state}" if self.state else ""
        return (f"{self.reason.value}: socket inode {self.inode} {self.local} of "
                f"{self.holder}, peer {self.peer}{ino}{state}{where}")


@dataclass(frozen=True)
class TcpConnection:
    """One TCP socket of the tree that has a remote end, both addresses as host:port."""

    inode: int
    local: str
    remote: str
    state: str
    holder: Holder


@dataclass(frozen=True)
class TcpSurvey:
    """The tree's TCP connections: those with both ends in the tree, and the others.

    `--tcp-established --network-lock skip` is sound for a tree exactly when `outside` is
    empty: every connection's two ends are frozen and dumped together.

    Example::

        t = survey(tree_pids(engine_pid)).tcp
        if t.outside: refuse(...)
        flags = ("--tcp-established",) if t.internal_present else ()
    """

    internal: tuple[TcpConnection, ...]
    outside: tuple[OutsideConnection, ...]

    @property
    def internal_present(self) -> bool:
        return bool(self.internal)


@dataclass(frozen=True)
class Survey:
    """Every connection of a tree that a dump cannot take (Unix and TCP), and its TCP."""

    outside: tuple[OutsideConnection, ...]
    tcp: TcpSurvey


@dataclass(frozen=True)
class UnixSocket:
    """One Unix socket as the kernel's sock_diag reports it."""

    inode: int
    type: int
    state: int
    name: str
    peer: int
    icons: tuple[int, ...]


# --- Unix sockets: the kernel's sock_diag netlink interface ------------------------------------
def _attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off + _NLATTR.size <= len(data):
        length, kind = _NLATTR.unpack_from(data, off)
        if length < _NLATTR.size:
            return
        yield kind & 0x3FFF, data[off + _NLATTR.size:off + length]
        off += (length + 3) & ~3


def _name(raw: bytes) -> str:
    if not raw:
        return ""
    if raw[0] == 0:  # abstract namespace
        return "@" + raw[1:].decode(errors="replace")
    return raw.rstrip(b"\0").decode(errors="replace")


def unix_sockets() -> dict[int, UnixSocket]:
    """Every Unix socket in this network namespace, by inode (one sock_diag dump).

    `ss -x` reads the same table; asking the kernel directly needs no iproute2 on the host.
    """
    req = _UNIX_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0,
                         UDIAG_SHOW_NAME | UDIAG_SHOW_PEER | UDIAG_SHOW_ICONS,
                         0xFFFFFFFF, 0xFFFFFFFF)
    out: dict[int, UnixSocket] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as nl:
        nl.sendall(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY,
                               NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while data := nl.recv(1 << 16):
            for kind, body in _messages(data):
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", body)[0]
                    raise OSError(err, f"sock_diag dump of Unix sockets: {os.strerror(err)}")
                if kind == SOCK_DIAG_BY_FAMILY:
                    s = _unix_socket(body)
                    out[s.inode] = s
    return out


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, body) of each netlink message in one datagram."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            raise OSError(f"sock_diag: malformed netlink message of {length} bytes")
        yield kind, data[off + _NLMSG.size:off + length]
        off += (length + 3) & ~3


def _unix_socket(body: bytes) -> UnixSocket:
    """One sock_diag answer about a Unix socket, with its name, peer and queued clients."""
    _, stype, state, _, ino, _, _ = _UNIX_MSG.unpack_from(body)
    name, peer, icons = "", 0, ()
    for akind, value in _attrs(body[_UNIX_MSG.size:]):
        if akind == UNIX_DIAG_NAME:
            name = _name(value)
        elif akind == UNIX_DIAG_PEER:
            peer = struct.unpack_from("=I", value)[0]
        elif akind == UNIX_DIAG_ICONS:
            icons = struct.unpack(f"={len(value) // 4}I", value)
    return UnixSocket(ino, stype, state, name, peer, icons)


# --- which process holds which socket ------------------------------------------------------------
def _command(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def socket_fds(pid: int, proc: Path = Path("/proc")) -> dict[int, int]:
    """{socket inode: fd} for one process; {} when it is gone or not ours to read."""
    fds: dict[int, int] = {}
    fd_dir = proc / str(pid) / "fd"
    with contextlib.suppress(OSError):
        for entry in os.scandir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(entry.path)
                if target.startswith("socket:["):
                    fds.setdefault(int(target[8:-1]), int(entry.name))
    return fds


def _holders(pids: Iterable[int], proc: Path) -> dict[int, Holder]:
    found: dict[int, Holder] = {}
    for pid in pids:
        for ino, fd in socket_fds(pid, proc).items():
            found.setdefault(ino, Holder(pid, _command(pid, proc), fd))
    return found


def _all_pids(proc: Path) -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.scandir(proc):
            if entry.name.isdigit():
                yield int(entry.name)


def _peer_holders(inodes: set[int], proc: Path) -> dict[int, list[Holder]]:
    """Who holds each of `inodes`, searching every process: only done to name a refusal."""
    found: dict[int, list[Holder]] = {}
    if not inodes:
        return found
    for pid in _all_pids(proc):
        for ino, fd in socket_fds(pid, proc).items():
            if ino in inodes:
                found.setdefault(ino, []).append(Holder(pid, _command(pid, proc), fd))
    return found


# --- TCP: /proc/PID/net/tcp and tcp6 -------------------------------------------------------------
@dataclass(frozen=True)
class _TcpEntry:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    inode: int


def _address(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    # The kernel prints each 32-bit word of the address in host byte order.
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # one peer may see a v4 socket, the other a v6 one
    return str(addr)


def _endpoint(field: str) -> tuple[str, int]:
    host, port = field.split(":")
    return _address(host), int(port, 16)


def parse_tcp_table(text: str) -> list[_TcpEntry]:
    """The rows of /proc/net/tcp or tcp6."""
    rows = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        rows.append(_TcpEntry(_endpoint(cols[1]), _endpoint(cols[2]), int(cols[3], 16),
                              int(cols[9])))
    return rows


def _show(ep: tuple[str, int]) -> str:
    host, port = ep
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _netns_tables(pids: Iterable[int], proc: Path) -> dict[str, list[_TcpEntry]]:
    """The TCP table of each network namespace the tree's processes live in."""
    tables: dict[str, list[_TcpEntry]] = {}
    for pid in pids:
        try:
            ns = os.readlink(proc / str(pid) / "ns" / "net")
        except OSError:
            ns = f"pid:{pid}"
        if ns in tables:
            continue
        rows: list[_TcpEntry] = []
        for name in ("tcp", "tcp6"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                rows += parse_tcp_table((proc / str(pid) / "net" / name).read_text())
        tables[ns] = rows
    return tables


def _tcp(tables: dict[str, list[_TcpEntry]], holders: dict[int, Holder]) -> TcpSurvey:
    internal: list[TcpConnection] = []
    outside: list[OutsideConnection] = []
    for rows in tables.values():
        mine = [r for r in rows if r.inode in holders]
        ends = {(r.local, r.remote) for r in mine}
        listening = {r.local[1] for r in mine if r.state == _TCP_LISTEN_STATE}
        by_ends = {(r.local, r.remote): r for r in rows if r.inode}
        for r in mine:
            if r.state in (_TCP_LISTEN_STATE, _TCP_CLOSE_STATE) or r.remote[1] == 0:
                continue  # a listener, or a socket that was never connected
            h = holders[r.inode]
            if (r.remote, r.local) in ends:
                internal.append(TcpConnection(r.inode, _show(r.local), _show(r.remote),
                                              TCP_STATES.get(r.state, str(r.state)), h))
                continue
            peer = by_ends.get((r.remote, r.local))
            outside.append(OutsideConnection(
                Outside.TCP_PEER, r.inode, _show(r.local), _show(r.remote), h,
                peer_inode=peer.inode if peer else 0,
                state=TCP_STATES.get(r.state, str(r.state))))
        for r in rows:
            # Queued on a listener of ours: no inode yet, its client possibly outside.
            if r.inode == 0 and r.state in _PENDING_TCP and r.local[1] in listening \
                    and (r.remote, r.local) not in ends:
                peer = by_ends.get((r.remote, r.local))
                lst = next(x for x in mine if x.state == _TCP_LISTEN_STATE
                           and x.local[1] == r.local[1])
                outside.append(OutsideConnection(
                    Outside.TCP_PENDING, lst.inode, _show(r.local), _show(r.remote),
                    holders[lst.inode], peer_inode=peer.inode if peer else 0,
                    state=TCP_STATES.get(r.state, str(r.state))))
    return TcpSurvey(tuple(internal), tuple(outside))


def _stable_read(tree: tuple[int, ...], proc: Path,
                 read: Callable[[], _T]) -> tuple[dict[int, Holder], _T]:
    """The tree's sockets and `read()` (the kernel's tables), taken so that they agree.

    A connection being accepted while the tables are read would be in neither: gone from
    the listener's queue, its new socket not yet in the fd table that was read first. So
    the fd tables are read again after the kernel's, until no socket came or went.
    """
    holders = _holders(tree, proc)
    for _ in range(20):
        tables = read()
        again = _holders(tree, proc)
        if again.keys() == holders.keys():
            return holders, tables
        holders = again
    return holders, read()  # the tree keeps opening sockets: the last reading, as it is


# --- Unix: which connections leave the tree ------------------------------------------------------
def _unix(holders: dict[int, Holder], table: dict[int, UnixSocket]) -> list[OutsideConnection]:
    mine = {ino: table[ino] for ino in holders if ino in table}
    # A listener's "icons" are the clients queued on it, not accepted yet; such a client
    # reports no peer (its peer, the listener's embryo socket, has no inode before accept).
    queued_on = {icon: s for s in table.values() for icon in s.icons}
    found: list[OutsideConnection] = []
    for ino, s in mine.items():
        h = holders[ino]
        local = s.name or "(unnamed)"
        if s.state == _TCP_LISTEN_STATE:
            for client in s.icons:
                if client in mine:
                    continue
                peer = table.get(client)
                found.append(OutsideConnection(
                    Outside.UNIX_PENDING, ino, local,
                    (peer.name or "an unnamed client") if peer
                    else "a client that closed before it was accepted", h, peer_inode=client))
            continue
        if not s.peer:
            lst = queued_on.get(ino)
            if lst is not None and lst.inode not in mine:
                # Ours, waiting in the queue of a listener outside.
                found.append(OutsideConnection(Outside.UNIX_PEER, ino, local,
                                               lst.name or "an unnamed listener", h,
                                               peer_inode=lst.inode, state="not accepted"))
            continue  # not connected, or its peer closed: CRIU dumps it semi-closed
        if s.peer in mine:
            continue
        peer = table.get(s.peer)
        peer_name = peer.name if peer and peer.name else ""
        if s.type == socket.SOCK_DGRAM:
            if peer_name:
                continue  # --ext-unix-sk reconnects it by name at restore
            reason = Outside.UNIX_DGRAM_UNNAMED
        else:
            reason = Outside.UNIX_PEER
        found.append(OutsideConnection(reason, ino, local, peer_name or "an unnamed socket", h,
                                       peer_inode=s.peer))
    return found


def _with_peer_holders(conns: Iterable[OutsideConnection],
                       proc: Path) -> tuple[OutsideConnection, ...]:
    conns = tuple(conns)
    found = _peer_holders({c.peer_inode for c in conns if c.peer_inode}, proc)
    return tuple(OutsideConnection(c.reason, c.inode, c.local, c.peer, c.holder, c.peer_inode,
                                   c.state, tuple(found.get(c.peer_inode, ())))
                 for c in conns)


def _survey(tree: tuple[int, ...], proc: Path,
            unix_table: Callable[[], dict[int, UnixSocket]]) -> Survey:
    holders, (tables, unix) = _stable_read(
        tree, proc, lambda: (_netns_tables(tree, proc), unix_table()))
    tcp = _tcp(tables, holders)
    return Survey((*_unix(holders, unix), *tcp.outside), tcp)


def _named(found: Survey, proc: Path) -> Survey:
    outside = _with_peer_holders(found.outside, proc)
    return Survey(outside, TcpSurvey(found.tcp.internal, tuple(
        c for c in outside if c.reason in (Outside.TCP_PEER, Outside.TCP_PENDING))))


def survey(pids: Iterable[int], proc: Path = Path("/proc"),
           unix_table: Callable[[], dict[int, UnixSocket]] = unix_sockets) -> Survey:
    """Every connection of the processes `pids` (a whole tree) whose other end is outside.

    Unix sockets come from the kernel's sock_diag (peers by inode) of the caller's network
    namespace, TCP from each namespace's /proc/PID/net/tcp{,6}. The processes holding the
    outside ends are named when they can be found.
    """
    return _named(_survey(tuple(pids), proc, unix_table), proc)


def refuse_outside_connections(
    pids: Iterable[int], proc: Path = Path("/proc"), *, settle_s: float = SETTLE_S,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    unix_table: Callable[[], dict[int, UnixSocket]] = unix_sockets,
) -> Survey:
    """The survey of a tree about to be dumped; OpenConnectionsError naming every connection
    from outside that is still open after `settle_s` seconds."""
    tree = tuple(pids)
    deadline = clock() + settle_s
    while True:
        found = _survey(tree, proc, unix_table)
        if not found.outside:
            return found
        if clock() >= deadline:
            # Who holds the other ends: a search of every process, so only for the refusal.
            raise OpenConnectionsError(_named(found, proc).outside)
        sleep(0.02)
