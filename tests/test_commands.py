"""The subprocess runner: results, failures with tails, timeouts, and the reaper's registry."""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import pytest

from agent import proc
from agent.commands import run
from agent.errors import CommandError


def test_a_result_is_typed():
    r = run(["sh", "-c", "echo out; echo err >&2"], timeout_s=10)
    assert (r.returncode, r.stdout, r.stderr, r.ok) == (0, "out\n", "err\n", True)
    assert r.argv == ("sh", "-c", "echo out; echo err >&2") and r.duration_s > 0


def test_a_failure_carries_the_tails_of_stderr_and_the_log(tmp_path: Path):
    log = tmp_path / "tool.log"
    log.write_text("".join(f"log line {i}\n" for i in range(100)))
    with pytest.raises(CommandError) as e:
        run(["sh", "-c", "echo boom >&2; exit 3"], timeout_s=10, log_path=log)
    msg = str(e.value)
    assert "exited with status 3" in msg and "boom" in msg
    assert "log line 99" in msg and "log line 50" not in msg
    assert run(["sh", "-c", "exit 3"], timeout_s=10, check=False).returncode == 3


def test_a_timeout_kills_the_command():
    t = time.monotonic()
    with pytest.raises(CommandError, match="timed out after 0.3 s"):
        run(["sleep", "30"], timeout_s=0.3)
    assert time.monotonic() - t < 10


def test_the_end_of_a_command_is_told_by_the_kernel_not_found_by_polling(monkeypatch):
    # Popen.wait(timeout) sleeps in steps growing to 50 ms between looks: a CRIU restore of
    # half a second was seen to end 0-50 ms late, on the critical path of every restore.
    naps: list[float] = []
    monkeypatch.setattr(time, "sleep", naps.append)
    r = run(["sleep", "0.3"], timeout_s=10)
    assert r.ok and r.duration_s >= 0.3
    assert naps == []


def test_a_child_left_behind_holding_the_output_does_not_keep_the_command_running():
    # A CRIU killed mid-dump leaves a helper behind with its stdout: the command is over
    # when its own process exits, whatever its orphans still hold.
    t = time.monotonic()
    r = run(["sh", "-c", "echo before; sleep 30 & echo after"], timeout_s=20)
    assert time.monotonic() - t < 5
    assert r.stdout == "before\nafter\n"


def test_a_missing_program_says_so():
    with pytest.raises(CommandError, match="cannot start /nonexistent/tool"):
        run(["/nonexistent/tool"], timeout_s=5)


def test_the_reaper_never_steals_a_commands_exit_status():
    # The agent reaps orphans in another thread; run() owns its child so the status is ours.
    proc.become_subreaper()
    stop = threading.Event()

    def reaper() -> None:
        while not stop.is_set():
            proc.reap_orphans()
            time.sleep(0.001)

    t = threading.Thread(target=reaper)
    t.start()
    try:
        # A thousand: a child started outside the runner lost its status about 1 in 200.
        codes = [run(["sh", "-c", "exit 7"], timeout_s=10, check=False).returncode
                 for _ in range(1000)]  # fmt: skip
    finally:
        stop.set()
        t.join()
        ctypes.CDLL(None).prctl(proc.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    assert codes == [7] * 1000


def test_env_replaces_the_environment_when_not_inherited(monkeypatch):
    monkeypatch.setenv("PITSTOP_TEST_AGENT_ONLY", "1")
    inherited = run(["sh", "-c", "echo ${PITSTOP_TEST_AGENT_ONLY:-unset}"], timeout_s=10,
                    env={"PATH": "/usr/bin:/bin"})
    replaced = run(["sh", "-c", "echo ${PITSTOP_TEST_AGENT_ONLY:-unset}"], timeout_s=10,
                   env={"PATH": "/usr/bin:/bin"}, inherit_env=False)
    assert (inherited.stdout.strip(), replaced.stdout.strip()) == ("1", "unset")
