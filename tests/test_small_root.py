"""The engine's small root (agent/deathsig.py --root): a tiny process that forks the engine,
hands it the supervisor's signals and ends as it ended, so the supervisor sees the engine's
own end through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent import proc


def _start(*command: str) -> subprocess.Popen[str]:
    return subprocess.Popen(proc.with_deathsig(list(command), root=True), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _child_of(root: int, timeout_s: float = 10.0) -> int:
    """The root's one child (the engine), once it has forked it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{root}/task/{root}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise AssertionError(f"the root {root} forked no engine in {timeout_s} s")


def _alive(pid: int) -> bool:
    st = proc.stat(pid)
    return st is not None and st.state != "Z"


def _runs(pid: int, program: bytes, timeout_s: float = 10.0) -> bool:
    """`pid` has exec'd `program` (right after the fork it is still the root's copy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == program:
            return True
        time.sleep(0.01)
    return False


def test_the_engine_s_exit_status_is_the_root_s():
    root = _start("sh", "-c", "echo answered; exit 3")
    out, _ = root.communicate(timeout=30)
    assert root.returncode == 3
    assert out == "answered\n"


def test_an_engine_killed_by_a_signal_shows_as_a_root_killed_by_that_signal():
    root = _start("sh", "-c", "kill -KILL $$")
    root.wait(timeout=30)
    assert root.returncode == -signal.SIGKILL
    root = _start("sh", "-c", "kill -TERM $$")
    root.wait(timeout=30)
    assert root.returncode == -signal.SIGTERM


def test_the_root_hands_the_engine_the_supervisor_s_sigterm_and_waits_for_its_drain():
    root = _start("sh", "-c", "trap 'echo draining; sleep 0.3; exit 7' TERM; "
                              "echo up; while :; do sleep 0.05; done")
    assert root.stdout is not None
    assert root.stdout.readline() == "up\n"
    engine = _child_of(root.pid)
    root.send_signal(signal.SIGTERM)
    assert root.wait(timeout=30) == 7
    assert root.stdout.read() == "draining\n"
    assert not _alive(engine)


def test_an_engine_dies_with_its_root():
    root = _start("sleep", "60")
    engine = _child_of(root.pid)
    assert _runs(engine, b"sleep")
    root.kill()
    root.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(engine), "the engine outlived its root"


def test_the_root_keeps_little_memory_of_its_own():
    # What CRIU reads back for it before the tree may run: a few MB, not an interpreter's
    # worth of imports (anything the root imports costs every restore).
    root = _start("sleep", "60")
    try:
        _child_of(root.pid)
        status = Path(f"/proc/{root.pid}/status").read_text()
        anon_kb = int(next(line.split()[1] for line in status.splitlines()
                           if line.startswith("RssAnon:")))
        assert anon_kb < 16 * 1024, f"the small root holds {anon_kb} kB of its own memory"
    finally:
        root.kill()
        root.wait(timeout=30)


def test_a_program_that_cannot_run_is_said_and_exits_127():
    root = _start("/nonexistent/pitstop-engine")
    _, err = root.communicate(timeout=30)
    assert root.returncode == 127
    assert "cannot run '/nonexistent/pitstop-engine'" in err


def test_the_root_refuses_to_start_an_engine_whose_agent_is_already_gone():
    not_the_parent = os.getpid() + 1
    r = subprocess.run([sys.executable, "-I", "-S", str(proc.DEATHSIG_WRAPPER),
                        str(not_the_parent), "--root", "--", "echo", "started"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 127
    assert "started" not in r.stdout
    assert f"the agent (PID {not_the_parent}) died before the engine started" in r.stderr


def test_the_benches_kill_the_api_server_under_the_small_root_as_a_crash_would(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from vllm_bench_kit import serving_pid

    root = _start("sleep", "60")
    try:
        engine = _child_of(root.pid)
        assert _runs(engine, b"sleep")
        assert serving_pid(root.pid) == engine
        assert serving_pid(engine) == engine
    finally:
        root.kill()
        root.wait(timeout=30)
