"""Snapshots taken after clients were served through the front: real agent, CRIU, engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agentproc import REPO, RunningAgent, agent_config, complete, snapshot_list
from tests.holder_proc import Holder
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required
from tests.test_agent_vllm import BOOT_S, io_uring_off  # noqa: F401 - a fixture
from tests.test_agent_vllm import NAME as VLLM_NAME
from tests.test_agent_vllm import _prerequisites as _vllm_prerequisites
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON

pytestmark = pytest.mark.integration


def _post(agent: RunningAgent, body: dict) -> bytes:
    req = urllib.request.Request(agent.front_url + "/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def _traffic(agent: RunningAgent, n: int = 2) -> None:
    """Whole and streaming answers through the front, each to its [DONE]; the front keeps
    its pooled connections to the engine afterwards."""
    model = agent.status_model()
    for i in range(n):
        whole = json.loads(_post(agent, {"model": model, "prompt": f"Whole {i}",
                                         "max_tokens": 6, "temperature": 0}))
        assert whole["choices"][0]["text"]
        events = _post(agent, {"model": model, "prompt": f"Stream {i}", "max_tokens": 6,
                               "temperature": 0, "stream": True}).decode()
        assert events.rstrip().endswith("data: [DONE]"), events[-300:]


def _create(agent: RunningAgent) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", "snapshot", "create", "--json",
                           "--config", str(agent.config_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


@pytest.fixture(params=["full", "hybrid"])
def manual(request, tmp_path: Path, tiny_model: Path) -> Iterator[tuple[RunningAgent, str]]:
    """An agent that takes snapshots only when asked: with a cpu holder for `hybrid`."""
    kind = request.param
    holder = Holder(tmp_path / "holder") if kind == "hybrid" else None
    extra = {"holder": {"enabled": True, "dir": str(tmp_path / "holder"), "gpu": "cpu"}} \
        if holder else {}
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model,
                                            snapshots={"regenerate": "manual"}, **extra))
    try:
        a.wait_ready()
        yield a, kind
    finally:
        a.stop()
        if holder is not None:
            holder.stop()


def test_a_snapshot_after_streaming_and_whole_answers_is_taken_and_restored(manual):
    a, kind = manual
    _traffic(a)
    r = _create(a)
    assert r.returncode == 0, r.stderr + a.log_tail(3000)
    [snap] = snapshot_list(a)
    assert snap["kind"] == kind and snap["id"] == json.loads(r.stdout)["id"]
    before = complete(a)  # the front opens its connections to the engine again
    _traffic(a, n=1)

    os.kill(a.status()["engine_pid"], signal.SIGKILL)
    st = a.wait_recovered(1)
    assert st["last_recovery"]["path"] == kind, st["last_recovery"]
    assert complete(a) == before  # the canary was verified, and it answers as before
    _traffic(a, n=1)
    again = _create(a)  # after traffic on the restored engine too
    assert again.returncode == 0, again.stderr


def test_a_connection_kept_open_from_outside_refuses_the_snapshot_and_names_it(
        tmp_path: Path, tiny_model: Path):
    a = RunningAgent(tmp_path, agent_config(tmp_path, tiny_model,
                                            snapshots={"regenerate": "manual"}))
    try:
        a.wait_ready()
        sock = Path(a.config["paths"]["state_dir"]) / "run" / "engine.sock"
        lingering = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lingering.connect(str(sock))
        with lingering:
            r = _create(a)
            assert r.returncode != 0
            # Named before CRIU ran: the reason, both ends, who holds ours.
            assert "unix_peer" in r.stderr and f"PID {os.getpid()}" in r.stderr, r.stderr
            assert f"inode {os.fstat(lingering.fileno()).st_ino}" in r.stderr, r.stderr
            assert "criu dump" not in r.stderr
            st = a.status()
            assert st["snapshot_error"].startswith("the snapshot was refused before CRIU ran")
            assert snapshot_list(a) == []
            assert complete(a)  # the engine kept serving
        r = _create(a)
        assert r.returncode == 0, r.stderr
    finally:
        a.stop()


def _replace_a_weight(model: Path) -> None:
    """A new weights file published as model updates are: written beside, renamed over.
    Rewriting the file in place instead would truncate pages the serving engine has mapped
    (safetensors maps the file), and its next request dies of SIGBUS: a crash, not a drift."""
    w = model / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-64] ^= 0x01
    tmp = w.with_name(w.name + ".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, w)


def test_a_drift_under_traffic_regenerates_the_snapshot(tmp_path: Path, tiny_model: Path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    a = RunningAgent(tmp_path, agent_config(tmp_path, model,
                                            snapshots={"drift_check_interval_s": 1}))
    stop = threading.Event()
    failures: list[str] = []
    served = [0]

    def clients() -> None:
        while not stop.is_set():
            try:
                _traffic(a, n=1)
                served[0] += 1
            except (OSError, urllib.error.URLError, AssertionError) as e:
                failures.append(repr(e))

    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        [first] = snapshot_list(a)
        t = threading.Thread(target=clients, daemon=True)
        t.start()
        a.wait_for(lambda s: served[0] >= 2, 60, "traffic")
        _replace_a_weight(model)
        st = a.wait_for(lambda s: (s.get("last_recovery") or {}).get("cause") == "drift"
                        and "published" in s.get("reason", ""), 180, "the regeneration")
        served_at_snapshot = served[0]
        a.wait_for(lambda s: served[0] > served_at_snapshot, 60, "traffic after it")
        stop.set()
        t.join(60)
        assert failures == [], failures
        assert st["snapshot_error"] == ""
        ids = [s["id"] for s in snapshot_list(a)]
        assert len(ids) == 2 and first["id"] in ids
        os.kill(st["engine_pid"], signal.SIGKILL)
        st = a.wait_recovered(1)
        assert st["last_recovery"]["path"] == "full"
        assert f"restored snapshot {ids[0]}" in a.log()
    finally:
        stop.set()
        a.stop()


@pytest.mark.usefixtures("io_uring_off")
def test_vllm_a_snapshot_after_whole_and_streaming_answers_through_the_front_is_published(
        tmp_path: Path, tiny_model: Path):
    """Real vLLM (CPU): uvicorn keeps the front's connections alive between requests."""
    _vllm_prerequisites()
    a = RunningAgent(tmp_path, agent_config(
        tmp_path, tiny_model,
        engine={"kind": "vllm", "python": str(VLLM_PYTHON), "served_model_name": VLLM_NAME,
                "args": CPU_ARGS, "stop_timeout_s": 20},
        health={"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                "start_timeout_s": BOOT_S},
        snapshots={"enabled": True, "regenerate": "manual"}))
    try:
        a.wait_ready(timeout=BOOT_S)
        _traffic(a)
        r = _create(a)
        assert r.returncode == 0, r.stderr + a.log_tail(3000)
        [snap] = snapshot_list(a)
        assert snap["id"] == json.loads(r.stdout)["id"]
        _traffic(a, n=1)  # served on after the dump, on new connections
    finally:
        a.stop(timeout=60)
