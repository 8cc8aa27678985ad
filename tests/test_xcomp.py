"""The AMX permission across a real CRIU restore: each restored process asks for it again.

CRIU does not save the permission arch_prctl(ARCH_REQ_XCOMP_PERM) grants, so a restored
process that used AMX dies with SIGILL at its next tile instruction. The tests that show
that (and that the re-grant prevents it) need a CPU with AMX and skip elsewhere: without
AMX no process can have had the permission, so there is nothing to lose. The ptrace
injection the re-grant is made of runs everywhere, on real restored processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent import proc
from agent.checkpoint.snapshotter import RestoredProcess
from agent.checkpoint.xcomp import (
    SYS_GETPID,
    SYS_GETPPID,
    XFEATURE_XTILEDATA,
    Grant,
    Regrant,
    _vdso,
    cpu_has_amx,
    inject_syscall,
    request_amx_self,
)
from agent.errors import SnapshotError
from tests.one_worker import OneWorker
from tests.prereq import require
from tests.snapshot_helpers import (
    CANARY,
    REPO,
    Workload,
    capture,
    identity,
    kill_and_reap,
    snapshotter,
    subreaper,  # noqa: F401 - autouse: this process reaps restored trees
)

pytestmark = pytest.mark.integration

SOURCE = REPO / "tests" / "workloads" / "tiles.c"
TILEDATA = 1 << XFEATURE_XTILEDATA
SYS_ACCEPT = 43
NO_AMX = "this CPU has no AMX (no amx_tile in /proc/cpuinfo): no process here can hold the "
NO_AMX += "permission, so a restore cannot lose it; the injection tests cover the mechanism"


@pytest.fixture(scope="module")
def tiles_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    require(gcc, "gcc is needed to build tests/workloads/tiles.c")
    assert gcc is not None
    out = tmp_path_factory.mktemp("tiles") / "tiles"
    r = subprocess.run([gcc, "-O2", "-Wall", "-o", str(out), str(SOURCE)],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


class Tiles(Workload):
    """tests/workloads/tiles.c: a process that uses AMX tiles on request."""

    def __init__(self, binary: Path, sock: Path, *extra: str) -> None:
        super().__init__([str(binary), str(sock), *extra], sock)


def ask(sock: Path, what: str) -> str | None:
    """One request; None when the server closed the connection without an answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(what.encode() + b"\n")
        try:
            data = s.recv(128)
        except ConnectionResetError:
            return None
        return data.decode().strip() or None


def spin(sock: Path) -> tuple[int, int]:
    """(iterations, errors) of the spinner child."""
    reply = ask(sock, "spin")
    assert reply is not None and reply.startswith("spin "), reply
    iterations, errors = reply.split()[1:]
    return int(iterations), int(errors)


def perm(sock: Path) -> int:
    reply = ask(sock, "perm")
    assert reply is not None and reply.startswith("perm "), reply
    return int(reply.split()[1], 16)


def wait_for_death(pid: int, timeout_s: float = 10) -> int:
    """The signal that killed `pid` (a restored process, our child as the subreaper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            assert os.WIFSIGNALED(status), f"PID {pid} exited with {os.WEXITSTATUS(status)}"
            return os.WTERMSIG(status)
        time.sleep(0.02)
    raise AssertionError(f"PID {pid} still runs after {timeout_s} s")


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    """Wait for `check` on a loaded machine (2 shared cores) instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def state_and_syscall(pid: int) -> tuple[str, str]:
    """Its /proc state letter and the first field of /proc/PID/syscall (the call it is in)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2], Path(f"/proc/{pid}/syscall").read_text().split()[0]


@contextlib.contextmanager
def restored_tiles(
    tmp_path: Path, binary: Path, regrant: Regrant, *extra: str, before: str = "",
) -> Iterator[tuple[RestoredProcess, Path]]:  # fmt: skip
    """A tiles server (with `before` asked of it) dumped, then restored with `regrant`;
    yields (the RestoredProcess, its socket) and kills and reaps the tree after."""
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    snap.regrant = regrant
    t = Tiles(binary, tmp_path / "t.sock", *extra)
    try:
        if before:
            assert ask(t.sock, before) is not None
        pids = ask(t.sock, "pids")
        info = capture(snap, t.pid, canary=CANARY, identity=identity(snap.criu.version))
    finally:
        t.stop()
    assert pids is not None
    child = int(pids.split()[2])
    if child:
        kill_and_reap(child)  # CRIU killed it with its parent; it was re-parented to us
    proc.reap_orphans()  # and a zombie child, re-parented to us too: its PID must be free
    r = snap.restore(info.manifest)
    try:
        yield r, t.sock
    finally:
        for pid in (child, r.pid):
            if pid:
                kill_and_reap(pid)
        proc.reap_orphans()
        for f in set(r.outputs.values()):
            f.close()


def test_every_restored_process_is_asked_to_regrant_and_the_tree_runs_on(
    tmp_path: Path, tiles_bin: Path
):
    with restored_tiles(tmp_path, tiles_bin, Regrant.ALWAYS, "--spinner") as (r, sock):
        pids = ask(sock, "pids")
        assert pids is not None
        root, child = (int(p) for p in pids.split()[1:])
        expected = Grant.GRANTED if cpu_has_amx() else Grant.NO_AMX
        assert r.amx == {root: expected, child: expected}
        assert r.timings["amx_regrant"] > 0
        # Continued after the re-grant: the spinner spins, with its registers intact.
        first, _ = spin(sock)
        eventually(lambda: spin(sock)[0] > first, "the spinner spins")
        assert spin(sock)[1] == 0


def test_a_zombie_in_the_restored_tree_is_left_out_of_the_regrant(tmp_path: Path, tiles_bin: Path):
    with restored_tiles(tmp_path, tiles_bin, Regrant.ALWAYS, "--zombie") as (r, sock):
        zombies = [p for p, state in proc.children_of(r.pid).items() if state == "Z"]
        assert len(zombies) == 1, proc.children_of(r.pid)  # CRIU restored it as one
        assert list(r.amx) == [r.pid]
        assert ask(sock, "pids") is not None


def test_without_amx_on_the_cpu_the_restore_asks_nothing_and_leaves_the_tree_running(
    tmp_path: Path, tiles_bin: Path
):
    if cpu_has_amx():
        pytest.skip("this CPU has AMX: Regrant.AUTO asks here (the test above covers it)")
    with restored_tiles(tmp_path, tiles_bin, Regrant.AUTO) as (r, sock):
        assert r.amx == {} and "amx_regrant" not in r.timings
        assert ask(sock, "pids") is not None


def test_a_syscall_injected_into_restored_processes_answers_and_each_continues_as_it_was(
    tmp_path: Path, tiles_bin: Path
):
    with restored_tiles(tmp_path, tiles_bin, Regrant.OFF, "--spinner") as (r, sock):
        pids = ask(sock, "pids")
        assert pids is not None
        root, child = (int(p) for p in pids.split()[1:])
        assert r.pid == root
        in_accept = ("S", str(SYS_ACCEPT))
        eventually(lambda: state_and_syscall(root) == in_accept, "the server blocks in accept()")
        before, _ = spin(sock)
        eventually(lambda: state_and_syscall(root) == in_accept, "the server blocks in accept()")
        for _ in range(50):
            # The server blocked in accept(), the spinner busy in user space.
            assert inject_syscall(root, SYS_GETPID) == root
            assert inject_syscall(child, SYS_GETPID) == child
            assert inject_syscall(child, SYS_GETPPID) == root
        # accept() was restarted (the server answers), the spinner's registers are intact.
        eventually(lambda: state_and_syscall(root) == in_accept, "accept() is restarted")
        assert ask(sock, "pids") == pids
        eventually(lambda: spin(sock)[0] > before, "the spinner spins on")
        assert spin(sock)[1] == 0


def test_a_stopped_process_stays_stopped_after_an_injected_syscall(tmp_path: Path, tiles_bin: Path):
    t = Tiles(tiles_bin, tmp_path / "t.sock")
    try:
        os.kill(t.pid, signal.SIGSTOP)
        eventually(lambda: state_and_syscall(t.pid)[0] == "T", "it stops")
        assert inject_syscall(t.pid, SYS_GETPID) == t.pid
        time.sleep(0.1)
        assert state_and_syscall(t.pid)[0] == "T"
        os.kill(t.pid, signal.SIGCONT)
        assert ask(t.sock, "pids") == f"pids {t.pid} 0"
    finally:
        t.stop()


def test_a_signal_pending_during_an_injection_is_delivered_after_it_with_its_payload(
    tmp_path: Path, tiles_bin: Path
):
    libc = ctypes.CDLL(None, use_errno=True)
    t = Tiles(tiles_bin, tmp_path / "t.sock")
    try:
        os.kill(t.pid, signal.SIGSTOP)
        eventually(lambda: state_and_syscall(t.pid)[0] == "T", "it stops")
        # Pending while it is stopped: the injected step dequeues it first, and it must
        # not run its handler on the injected registers, nor be lost.
        assert libc.sigqueue(t.pid, signal.SIGRTMIN, ctypes.c_void_p(42)) == 0
        assert inject_syscall(t.pid, SYS_GETPID) == t.pid
        os.kill(t.pid, signal.SIGCONT)
        assert ask(t.sock, "sigs") == "sigs 1 42"
        assert ask(t.sock, "pids") == f"pids {t.pid} 0"
    finally:
        t.stop()


def test_the_vdso_comes_from_the_auxiliary_vector_and_from_the_maps_without_it(tmp_path: Path):
    # An engine's maps are thousands of lines: the auxiliary vector says where the vDSO is.
    pid = os.getpid()
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        [(lo, hi)] = _vdso(pid, fd, Path("/proc"))
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "maps").write_text(Path(f"/proc/{pid}/maps").read_text())
        [(maps_lo, maps_hi)] = _vdso(pid, fd, tmp_path)  # no auxv there
        assert os.pread(fd, 2, hi - 2)  # every byte of the span is readable
    finally:
        os.close(fd)
    assert maps_lo == lo < hi <= maps_hi


def test_injecting_into_a_process_that_is_gone_names_the_pid(tiles_bin: Path):
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(SnapshotError, match=f"PID {p.pid} is gone"):
        inject_syscall(p.pid, SYS_GETPID)


def test_a_restored_amx_user_survives_its_next_tile_instruction(tmp_path: Path, tiles_bin: Path):
    if not cpu_has_amx():
        pytest.skip(NO_AMX)
    with restored_tiles(tmp_path, tiles_bin, Regrant.AUTO, before="tile") as (r, sock):
        assert r.amx == {r.pid: Grant.GRANTED}
        assert perm(sock) & TILEDATA
        assert ask(sock, "tile") == "tile 2"


def test_without_the_regrant_a_restored_amx_user_dies_of_sigill(tmp_path: Path, tiles_bin: Path):
    if not cpu_has_amx():
        pytest.skip(NO_AMX)
    with restored_tiles(tmp_path, tiles_bin, Regrant.OFF, before="tile") as (r, sock):
        assert r.amx == {}
        assert not perm(sock) & TILEDATA  # what CRIU lost
        assert ask(sock, "tile") is None
        assert wait_for_death(r.pid) == signal.SIGILL


def test_a_refused_regrant_fails_the_restore_kills_the_tree_and_the_rung_quarantines_it(
    tmp_path: Path, tiles_bin: Path
):
    from prometheus_client import CollectorRegistry

    from agent.errors import StartPathError
    from agent.metrics import Metrics
    from agent.refusal import RefusalCode
    from agent.supervisor.ladder import Attempt, Prepared
    from agent.supervisor.paths.restore import FullRestore

    # The workload holds the permission, then forbids arch_prctl (seccomp, restored by
    # CRIU with it): the re-grant inside it gets EPERM, on any CPU.
    snap = snapshotter(tmp_path / "snaps", tmp_path / "logs")
    snap.regrant = Regrant.ALWAYS
    t = Tiles(tiles_bin, tmp_path / "t.sock", "--deny-arch-prctl")
    ident = identity(snap.criu.version)
    try:
        info = capture(snap, t.pid, canary=CANARY, identity=ident)
    finally:
        t.stop()
    rung = FullRestore(
        snapshotter=snap, unavailable="", adapter=OneWorker(),  # type: ignore[arg-type]
        socket=t.sock, identity=lambda: ident, timeout_s=10,
        metrics=Metrics(CollectorRegistry(), status=lambda: None),  # type: ignore[arg-type]
    )  # fmt: skip
    attempt = Attempt(cause="test")
    prepared = asyncio.run(rung.prepare(attempt))
    assert isinstance(prepared, Prepared), prepared
    with pytest.raises(StartPathError) as e:
        asyncio.run(rung.start(attempt, prepared))
    assert e.value.refusal.code is RefusalCode.RESTORE_FAILED
    msg = str(e.value)
    print(msg)
    assert f"PID {t.pid}" in msg and "Operation not permitted" in msg, msg
    assert wait_for_death(t.pid) == signal.SIGKILL  # killed by the restore, not left stopped
    assert snap.store.ids() == [] and snap.store.select(ident).chosen is None
    quarantined = snap.store.root / ".quarantine"
    assert [d.name.split(".")[0] for d in quarantined.iterdir()] == [info.id]


def test_regrant_auto_asks_only_where_the_cpu_reports_amx_tiles(tmp_path: Path):
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    for root, flags in ((amx, "fpu avx512f amx_bf16 amx_tile amx_int8"), (plain, "fpu avx2")):
        root.mkdir()
        (root / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n\n")
    assert Regrant.AUTO.active(amx) and not Regrant.AUTO.active(plain)
    assert Regrant.ALWAYS.active(plain) and not Regrant.OFF.active(amx)
    assert not Regrant.AUTO.active(tmp_path / "absent")


def test_an_engine_asking_for_itself_is_granted_where_there_is_amx_and_told_no_amx_elsewhere():
    # What the reference engine's /pitstop/resume calls; a repeat is harmless.
    expected = Grant.GRANTED if cpu_has_amx() else Grant.NO_AMX
    assert request_amx_self() == expected
    assert request_amx_self() == expected
