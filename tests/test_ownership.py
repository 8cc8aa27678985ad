"""Which processes a dead agent's engine record names, read from a fixture /proc; the state
directory lock between two real processes; the tether on a real process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent import proc
from agent.errors import AgentRunningError
from agent.supervisor.ownership import EngineLedger, StateLock

REPO = Path(__file__).resolve().parent.parent
BOOT = "6f1c1e3e-0000-4000-8000-000000000001"


class FakeProc:
    """A /proc with the files the ledger reads: boot_id and each process's stat."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "sys" / "kernel" / "random").mkdir(parents=True)
        self.boot(BOOT)

    def boot(self, boot_id: str) -> None:
        (self.root / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")

    def add(self, pid: int, *, ppid: int, pgid: int, session: int, start: int,
            state: str = "S", name: str = "python3") -> None:
        d = self.root / str(pid)
        d.mkdir()
        # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt
        # majflt cmajflt utime stime cutime cstime priority nice num_threads itrealvalue
        # starttime ...
        fields = [state, ppid, pgid, session, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 20, 0, 1, 0,
                  start, 0, 0]
        (d / "stat").write_text(f"{pid} ({name}) " + " ".join(map(str, fields)) + "\n")

    def remove(self, pid: int) -> None:
        for f in (self.root / str(pid)).iterdir():
            f.unlink()
        (self.root / str(pid)).rmdir()


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


def _recorded(state: Path, fake: FakeProc) -> EngineLedger:
    """A ledger that recorded engine 500 (group and session 500, started at tick 1000)."""
    fake.add(500, ppid=1, pgid=500, session=500, start=1000)
    ledger = EngineLedger(state, proc_root=fake.root)
    ledger.record(500)
    return ledger


def test_a_live_engine_root_is_found_with_its_children(state, fake):
    ledger = _recorded(state, fake)
    fake.add(501, ppid=500, pgid=500, session=500, start=1010, name="VLLM::EngineCore")
    assert ledger.leftovers() == [500, 501]


def test_with_its_root_gone_the_rest_of_the_engine_group_is_still_found(state, fake):
    ledger = _recorded(state, fake)
    fake.add(501, ppid=1, pgid=500, session=500, start=1010, name="VLLM::EngineCore")
    fake.remove(500)
    assert ledger.leftovers() == [501]


def test_a_stranger_that_took_the_engine_pid_is_left_alone_with_its_group(state, fake):
    ledger = _recorded(state, fake)
    fake.remove(500)
    # The PID came back to a new session leader: while the engine's group had a member,
    # the kernel could not have given it out, so none of group 500 is the engine's.
    fake.add(500, ppid=1, pgid=500, session=500, start=9000, name="sshd")
    fake.add(502, ppid=500, pgid=500, session=500, start=9010, name="sshd")
    assert ledger.leftovers() == []


def test_a_group_member_in_another_session_is_left_alone(state, fake):
    ledger = _recorded(state, fake)
    fake.remove(500)
    fake.add(600, ppid=1, pgid=500, session=600, start=2000)
    assert ledger.leftovers() == []


def test_a_record_from_another_boot_names_nothing(state, fake):
    ledger = _recorded(state, fake)
    fake.boot("6f1c1e3e-0000-4000-8000-000000000002")
    assert ledger.leftovers() == []


def test_a_record_that_does_not_parse_names_nothing_and_says_so(state, fake, caplog):
    ledger = EngineLedger(state, proc_root=fake.root)
    ledger.path.write_text('{"pid": "500"}')
    assert ledger.leftovers() == []
    assert "does not read as an engine record" in caplog.text


def test_a_second_process_cannot_take_the_lock_and_is_told_who_holds_it(state):
    with StateLock.take(state):
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from agent.supervisor.ownership import StateLock
            StateLock.take(Path({str(state)!r}))
        """)], capture_output=True, text=True, cwd=REPO, timeout=30)
        assert r.returncode != 0
        assert "AgentRunningError" in r.stderr
        assert f"another agent (PID {os.getpid()}) already runs on state directory" in r.stderr
    # Released with the descriptor: the next one takes it.
    StateLock.take(state).release()


def test_the_lock_is_not_inherited_by_children(state):
    with StateLock.take(state) as lock:
        r = subprocess.run(["ls", "-l", "/proc/self/fd/"], capture_output=True, text=True,
                           timeout=30, close_fds=False)
        assert str(lock.path) not in r.stdout


def test_taking_the_lock_in_the_same_process_twice_is_refused(state):
    with StateLock.take(state), pytest.raises(AgentRunningError, match="stop it first"):
        StateLock.take(state)


def test_the_tether_kills_the_engine_group_when_the_agent_pipe_closes():
    # A stand-in engine tree: a shell leading its own group, and a child of it in the group.
    group = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE,
                             start_new_session=True)
    assert group.stdout is not None
    child = int(group.stdout.readline())
    read, write = os.pipe()
    tether = subprocess.Popen([sys.executable, "-m", "agent.tether"], stdin=read, cwd=REPO,
                              stderr=subprocess.PIPE, text=True)
    os.close(read)
    try:
        st = proc.stat(group.pid)
        assert st is not None
        os.write(write, b"\n")  # an engine that stopped cleanly names nothing ...
        os.write(write, f"{group.pid} {st.start_time} {st.pgid} {st.session}\n".encode())
        time.sleep(0.3)
        assert group.poll() is None, "the tether acted before the pipe closed"
        os.close(write)  # ... the agent died: the kernel closes its end
        write = -1
        assert group.wait(10) == -signal.SIGKILL
        _, err = tether.communicate(timeout=10)
        assert tether.returncode == 0
        assert f"killed what was left of its engine: PIDs [{group.pid}, {child}]" in err
        assert not proc.pid_alive(child)
    finally:
        if write >= 0:
            os.close(write)
        for p in (group, tether):
            if p.poll() is None:
                p.kill()
                p.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
