"""Which TCP connections of a tree are internal, read from a fixture /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.checkpoint.netlock import ExternalConnectionError, NetworkLock, choose_lock

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
          "timeout inode\n")


def _row(local: str, remote: str, state: str, inode: int) -> str:
    return (f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0   "
            f"     0 {inode} 1\n")


def _proc(root: Path, sockets: dict[int, list[int]], tcp: list[str], tcp6: list[str]) -> Path:
    """A /proc with `sockets` (PID -> socket inodes it holds) and the two TCP tables."""
    for pid, inodes in sockets.items():
        (root / str(pid) / "fd").mkdir(parents=True)
        (root / str(pid) / "comm").write_text("python\n")
        for fd, inode in enumerate(inodes):
            os.symlink(f"socket:[{inode}]", root / str(pid) / "fd" / str(fd))
    net = root / str(next(iter(sockets))) / "net"
    net.mkdir()
    (net / "tcp").write_text(HEADER + "".join(tcp))
    (net / "tcp6").write_text(HEADER + "".join(tcp6))
    return root


# 127.0.0.1 is 0100007F in the kernel's host-order hex; ports 0x1F90 = 8080, 0xA000 = 40960.
LO_8080, LO_40960 = "0100007F:1F90", "0100007F:A000"
# ::ffff:127.0.0.1, as a dual-stack socket sees an IPv4 peer.
MAPPED_8080 = "0000000000000000FFFF00000100007F:1F90"
OUTSIDE = "0700000A:1538"  # 10.0.0.7:5432


def test_a_loopback_connection_between_two_processes_of_the_tree_needs_no_lock(tmp_path):
    proc = _proc(tmp_path, {10: [1, 2], 11: [3]},
                 tcp=[_row(LO_8080, "00000000:0000", "0A", 1),   # the listener
                      _row(LO_8080, LO_40960, "01", 2),          # its accepted end
                      _row(LO_40960, LO_8080, "01", 3)],         # the client, in PID 11
                 tcp6=[])
    assert choose_lock((10, 11), leave_running=True, proc_root=proc) == (True, NetworkLock.SKIP)


def test_a_tree_with_only_a_listener_dumps_without_tcp_established(tmp_path):
    proc = _proc(tmp_path, {10: [1]}, tcp=[_row(LO_8080, "00000000:0000", "0A", 1)], tcp6=[])
    assert choose_lock((10,), leave_running=True, proc_root=proc) == (False, NetworkLock.SKIP)


def test_a_dual_stack_end_matches_its_ipv4_peer(tmp_path):
    proc = _proc(tmp_path, {10: [2, 3]},
                 tcp=[_row(LO_40960, LO_8080, "01", 3)],
                 tcp6=[_row(MAPPED_8080, "0000000000000000FFFF00000100007F:A000", "01", 2)])
    assert choose_lock((10,), leave_running=True, proc_root=proc) == (True, NetworkLock.SKIP)


def test_a_connection_to_another_host_is_refused_and_named(tmp_path):
    proc = _proc(tmp_path, {10: [5]}, tcp=[_row(LO_40960, OUTSIDE, "01", 5)], tcp6=[])
    with pytest.raises(ExternalConnectionError) as refused:
        choose_lock((10,), leave_running=True, proc_root=proc)
    assert "PID 10 (python) 127.0.0.1:40960 -> 10.0.0.7:5432" in str(refused.value)
    # A dump that stops the tree could hold the peer off with nftables, where nft exists.
    assert choose_lock((10,), leave_running=False, proc_root=proc, nft="/usr/sbin/nft") == (
        True, NetworkLock.NFTABLES)


def test_sockets_of_other_processes_are_not_the_trees(tmp_path):
    proc = _proc(tmp_path, {10: [1]}, tcp=[_row(LO_8080, "00000000:0000", "0A", 1),
                                            _row(LO_40960, OUTSIDE, "01", 99)], tcp6=[])
    assert choose_lock((10,), leave_running=True, proc_root=proc) == (False, NetworkLock.SKIP)
