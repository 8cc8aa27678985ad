"""The connection survey on real sockets: which connections of a tree reach outside it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.checkpoint.connections import (
    Outside,
    parse_tcp_table,
    refuse_outside_connections,
    survey,
    unix_sockets,
)
from agent.checkpoint.criu import DumpOptions
from agent.checkpoint.snapshotter import tree_pids
from agent.errors import OpenConnectionsError

HOLDER = Path(__file__).parent / "workloads" / "sockholder.py"


class Held:
    """tests/workloads/sockholder.py: a process (tree) holding one socket until stopped."""

    def __init__(self, *args: str, pass_fds: tuple[int, ...] = ()) -> None:
        self.p = subprocess.Popen([sys.executable, str(HOLDER), *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, pass_fds=pass_fds)
        assert self.p.stdout is not None
        line = self.p.stdout.readline().decode().split()
        assert line[:1] == ["ready"], line
        self.info = line[1] if len(line) > 1 else ""
        self.pid = self.p.pid

    def stop(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(timeout=10)
        assert self.p.stdout is not None
        self.p.stdout.close()


@contextlib.contextmanager
def held(*args: str, pass_fds: tuple[int, ...] = ()) -> Iterator[Held]:
    h = Held(*args, pass_fds=pass_fds)
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="pitstop-conn-"))  # short: sun_path holds 108 bytes
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


def test_sock_diag_reports_both_ends_of_a_socketpair_as_each_others_peer():
    a, b = socket.socketpair()
    with a, b:
        table = unix_sockets()
        assert table[_inode(a)].peer == _inode(b)
        assert table[_inode(b)].peer == _inode(a)
        assert table[_inode(a)].type == socket.SOCK_STREAM


def test_a_socketpair_inside_one_process_is_not_outside():
    a, b = socket.socketpair()
    with a, b:
        assert survey([os.getpid()]).outside == ()


def test_a_socketpair_across_two_processes_of_the_tree_is_inside():
    with held("tree-pair") as h:
        pids = tree_pids(h.pid)
        assert int(h.info) in pids
        assert survey(pids).outside == ()
        # The same pair seen from the parent alone: its peer lives in the child.
        [c] = survey([h.pid]).outside
        assert c.reason is Outside.UNIX_PEER
        assert [p.pid for p in c.peer_holders] == [int(h.info)]


def test_a_client_connected_to_a_listener_outside_is_named_with_its_holder(sockdir):
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(sockdir / "engine.sock"))
    lst.listen(1)
    with lst, held("unix-connect", str(sockdir / "engine.sock")) as h:
        conn, _ = lst.accept()
        with conn:
            [c] = survey([h.pid]).outside
            assert c.reason is Outside.UNIX_PEER
            assert c.holder.pid == h.pid and c.holder.command.startswith("python")
            assert c.peer_inode == _inode(conn)
            assert c.peer == str(sockdir / "engine.sock")  # accepted sockets carry the name
            assert [p.pid for p in c.peer_holders] == [os.getpid()]
            assert f"PID {h.pid}" in str(c) and f"inode {c.inode}" in str(c)


def test_an_idle_connection_from_outside_to_the_trees_socket_is_found(sockdir):
    """The case of the issue: the front's pooled connection to the engine's socket."""
    path = sockdir / "engine.sock"
    with held("unix-listen", str(path)) as h:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        with client:
            [c] = survey([h.pid]).outside
            assert c.reason is Outside.UNIX_PENDING  # not accepted: still in the queue
            assert c.local == str(path)
            assert c.peer_inode == _inode(client)
        # Closed, but never accepted: CRIU refuses the queued end as well ("closed in-flight
        # socket"), so it is still named, now without a peer.
        [c] = survey([h.pid]).outside
        assert c.reason is Outside.UNIX_PENDING and c.peer_inode == 0


def test_a_tree_client_still_queued_on_a_listener_outside_is_found(sockdir):
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(sockdir / "holder.sock"))
    lst.listen(1)  # never accepts
    with lst, held("unix-connect", str(sockdir / "holder.sock")) as h:
        [c] = survey([h.pid]).outside
        assert c.reason is Outside.UNIX_PEER and c.state == "not accepted"
        assert c.peer == str(sockdir / "holder.sock") and c.peer_inode == _inode(lst)


def test_a_closed_peer_leaves_nothing_outside(sockdir):
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(sockdir / "s"))
    lst.listen(1)
    with lst, held("unix-connect", str(sockdir / "s")) as h:
        conn, _ = lst.accept()
        conn.close()
        # The tree's end stays open, its peer gone: CRIU dumps it as a semi-closed socket.
        assert survey([h.pid]).outside == ()


def test_a_datagram_socket_is_outside_only_when_its_peer_has_no_name(sockdir):
    named = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    named.bind(str(sockdir / "log"))
    with named, held("dgram-connect", str(sockdir / "log")) as h:
        assert survey([h.pid]).outside == ()  # --ext-unix-sk reconnects it by name
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b, held("hold", str(b.fileno()), pass_fds=(b.fileno(),)) as h:
        [c] = survey([h.pid]).outside
        assert c.reason is Outside.UNIX_DGRAM_UNNAMED


def test_a_loopback_tcp_pair_inside_the_tree_is_internal():
    with held("tcp-self") as h:
        t = survey([h.pid]).tcp
        assert t.internal_present and t.outside == ()
        assert len(t.internal) == 2  # both ends, each seen from its own socket
        assert {c.state for c in t.internal} == {"ESTABLISHED"}
        assert survey([h.pid]).outside == ()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_tcp_connection_to_a_server_outside_is_named_with_both_addresses(host):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        lst = socket.create_server((host, 0), family=family)
    except OSError as e:
        pytest.skip(f"no {host} loopback here: {e}")
    port = lst.getsockname()[1]
    with lst, held("tcp-connect", host, str(port)) as h:
        conn, _ = lst.accept()
        with conn:
            t = survey([h.pid]).tcp
            assert not t.internal_present
            [c] = t.outside
            assert c.reason is Outside.TCP_PEER and c.state == "ESTABLISHED"
            shown = f"[{host}]" if ":" in host else host
            assert c.local == f"{shown}:{h.info}" and c.peer == f"{shown}:{port}"
            assert c.peer_inode == _inode(conn)
            assert [p.pid for p in c.peer_holders] == [os.getpid()]
            assert survey([h.pid]).outside == t.outside


def test_a_tcp_client_queued_on_the_trees_listener_is_outside():
    with held("tcp-listen", "127.0.0.1") as h:
        t = survey([h.pid]).tcp
        assert t.outside == () and not t.internal_present  # a listener alone is fine
        with socket.create_connection(("127.0.0.1", int(h.info))) as client:
            [c] = survey([h.pid]).tcp.outside
            assert c.reason is Outside.TCP_PENDING
            assert c.peer == f"127.0.0.1:{client.getsockname()[1]}"
            assert c.holder.pid == h.pid


def test_the_kernels_tcp_table_is_read_in_host_byte_order():
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
            "  timeout inode\n"
            "   0: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0"
            "        0 4242 1 0000000000000000 20 4 30 10 -1\n")
    if sys.byteorder != "little":
        pytest.skip("the sample row is from a little-endian host")
    [row] = parse_tcp_table(text)
    assert row.local == ("127.0.0.1", 8080) and row.remote == ("127.0.0.1", 54321)
    assert row.state == 1 and row.inode == 4242
    [row6] = parse_tcp_table(text.replace("0100007F:1F90", "0000000000000000FFFF00000100007F:1F90"))
    assert row6.local == ("127.0.0.1", 8080)  # v4-mapped: comparable with the v4 peer


def test_a_refusal_names_every_connection_and_a_closing_one_is_given_time(sockdir):
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(sockdir / "engine.sock"))
    lst.listen(1)
    with lst, held("unix-connect", str(sockdir / "engine.sock")) as h:
        conn, _ = lst.accept()
        with pytest.raises(OpenConnectionsError) as e:
            refuse_outside_connections([h.pid], settle_s=0.1)
        assert e.value.reasons == (Outside.UNIX_PEER,)
        [c] = e.value.connections
        assert str(c.inode) in str(e.value) and f"PID {h.pid}" in str(e.value)
        # Closed while the check waits: no refusal.
        closes: list[float] = []

        def sleep(s: float) -> None:
            if not closes:
                conn.close()
            closes.append(s)

        assert refuse_outside_connections([h.pid], settle_s=5, sleep=sleep).outside == ()
        assert len(closes) == 1


def test_the_snapshotter_refuses_a_tree_with_a_connection_from_outside_before_criu_runs(
        tmp_path: Path, sockdir: Path):
    from tests.snapshot_helpers import CANARY, Counter, capture, identity, snapshotter

    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    c = Counter(sockdir / "c.sock")
    try:
        lingering = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lingering.connect(str(c.sock))  # accepted, never sends: the counter waits on it
        with lingering, pytest.raises(OpenConnectionsError) as e:
            capture(snap, c.pid, canary=CANARY, identity=identity())
        assert e.value.reasons == (Outside.UNIX_PEER,)
        assert f"PID {c.pid}" in str(e.value) and f"PID {os.getpid()}" in str(e.value)
        assert snap.store.entries() == []
        assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
        assert c.inc() == 1  # it serves on
        info = capture(snap, c.pid, canary=CANARY, identity=identity(),
                            options=DumpOptions(leave_running=True))
        assert info.manifest.process.root_pid == c.pid
        assert c.inc() == 2
    finally:
        c.stop()
