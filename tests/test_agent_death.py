"""An engine never outlives its agent, and one agent owns a state directory: real agents,
real reference engines, real CRIU, the agent SIGKILLed outside systemd."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent import proc
from agent.supervisor.ownership import EngineLedger
from tests.agentproc import REPO, RunningAgent, agent_config
from tests.snapshot_helpers import criu

pytestmark = pytest.mark.integration


def _engines_on(state_dir: Path) -> list[int]:
    """Every live reference engine serving this state directory's socket."""
    sock = str(state_dir / "run" / "engine.sock")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.engines.refengine" in argv and sock.encode() in argv \
                and proc.pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _gone(pid: int, start_time: int, timeout: float = 10) -> bool:
    """True once `pid` (the process that started at `start_time`) no longer runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = proc.stat(pid)
        if st is None or st.state == "Z" or st.start_time != start_time:
            return True
        time.sleep(0.05)
    return False


def _sigkill_agent(a: RunningAgent) -> None:
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)


def _state_dir(a: RunningAgent) -> Path:
    return Path(a.config["paths"]["state_dir"])


@pytest.fixture
def cold(tmp_path, tiny_model):
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model, snapshots={"enabled": False}))
    try:
        a.wait_ready()
        yield a
    finally:
        a.stop()


@pytest.fixture
def snapped(tmp_path, tiny_model):
    """An agent that cold-started and took its first snapshot."""
    criu()
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model))
    try:
        a.wait_ready()
        a.wait_for(lambda s: s["state"] == "ready" and "published" in s.get("reason", ""), 120,
                   "the first snapshot")
        yield a
    finally:
        a.stop()


def _tether(a: RunningAgent) -> int:
    [pid] = re.findall(r"tether PID (\d+) kills what the engine leaves", a.log())
    return int(pid)


def test_an_agent_sigkilled_outside_systemd_takes_its_engine_with_it(cold):
    pid = cold.status()["engine_pid"]
    started = proc.stat(pid).start_time
    tether = _tether(cold)
    tether_started = proc.stat(tether).start_time
    _sigkill_agent(cold)
    assert _gone(pid, started), f"engine {pid} outlived its agent: {proc.stat(pid)}"
    assert _engines_on(_state_dir(cold)) == []
    # The helper that would have killed the rest of the engine's group is gone too.
    assert _gone(tether, tether_started), "the tether outlived the agent"


def test_an_agent_that_stops_cleanly_leaves_no_record_and_no_tether(cold):
    tether = _tether(cold)
    tether_started = proc.stat(tether).start_time
    assert cold.stop() == 0
    assert not (_state_dir(cold) / "engine.json").exists()
    assert _gone(tether, tether_started)
    assert "pitstop tether:" not in cold.log()  # it had nothing to kill


def test_a_restored_engine_dies_with_the_agent_that_restored_it(snapped):
    a = snapped
    pid = a.status()["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    st = a.wait_recovered(1)
    assert st["last_recovery"]["path"] == "full", st["last_recovery"]
    # CRIU gives the restored root its PID back, as the agent's own child: the death signal
    # it had at the dump is armed again, and CRIU's exit did not fire it.
    restored = proc.stat(pid)
    assert restored is not None and restored.ppid == a.proc.pid, restored
    _sigkill_agent(a)
    assert _gone(pid, restored.start_time), f"restored engine {pid} outlived its agent"
    assert _engines_on(_state_dir(a)) == []


def test_a_second_agent_on_the_same_state_directory_refuses_and_names_the_first(cold):
    engine = cold.status()["engine_pid"]
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(cold.config_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"another agent (PID {cold.proc.pid}) already runs on state directory" in r.stderr
    assert "stop it first" in r.stderr and "paths.state_dir" in r.stderr
    # The refused agent touched nothing: the first still serves with the same engine.
    assert cold.status()["state"] == "ready" and cold.status()["engine_pid"] == engine
    assert _engines_on(_state_dir(cold)) == [engine]
    # The lock is the agent's alone: its engine did not inherit the descriptor.
    lock = str(_state_dir(cold) / "agent.lock")
    fds = Path(f"/proc/{engine}/fd")
    assert lock not in [os.readlink(fd) for fd in fds.iterdir()]


def test_an_agent_restarted_after_a_sigkill_restores_exactly_one_engine(snapped, tmp_path):
    a = snapped
    _sigkill_agent(a)
    again = RunningAgent(tmp_path, a.config)
    try:
        st = again.wait_ready()
        assert st["last_recovery"]["path"] == "full", st["last_recovery"]
        assert _engines_on(_state_dir(again)) == [st["engine_pid"]]
    finally:
        again.stop()


def test_the_next_agent_kills_an_engine_that_a_dead_agent_left_behind(tmp_path, tiny_model):
    # An engine that would outlive its agent (one started by an older Pitstop, without the
    # death signal), recorded in the state directory the way the agent records its own.
    cfg = agent_config(tmp_path, tiny_model, snapshots={"enabled": False})
    state = Path(cfg["paths"]["state_dir"])
    (state / "run").mkdir(parents=True, mode=0o700)
    sock = state / "run" / "engine.sock"
    log = open(tmp_path / "leftover.log", "wb")  # noqa: SIM115 - closed below
    left = subprocess.Popen(
        [sys.executable, "-m", "agent.engines.refengine", "--model", str(tiny_model),
         "--uds", str(sock), "--device", "cpu"], cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    # Its parent (this test) reaps it as soon as it dies, as init would for a real orphan.
    reaper = threading.Thread(target=left.wait, daemon=True)
    reaper.start()
    try:
        started = proc.stat(left.pid).start_time
        EngineLedger(state).record(left.pid)
        a = RunningAgent(tmp_path, cfg)
        try:
            st = a.wait_ready()
            reaper.join(10)
            assert left.returncode == -signal.SIGKILL
            assert "still exist" not in a.log()
            assert f"killing PIDs [{left.pid}]" in a.log()
            assert _engines_on(state) == [st["engine_pid"]]
            assert st["engine_pid"] != left.pid or proc.stat(left.pid).start_time != started
        finally:
            a.stop()
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()
        log.close()


def test_the_death_signal_wrapper_refuses_to_start_an_engine_whose_agent_is_already_gone():
    not_the_parent = os.getpid() + 1
    r = subprocess.run([sys.executable, "-I", "-S", str(proc.DEATHSIG_WRAPPER),
                        str(not_the_parent), "--", "echo", "started"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 127
    assert "started" not in r.stdout
    assert f"the agent (PID {not_the_parent}) died before the engine started" in r.stderr
