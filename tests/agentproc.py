"""Start a real `pitstop run` for a test, find its ports, wait for states, stop it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from agent.supervisor.ownership import EngineLedger
from tests.holder_proc import Holder

REPO = Path(__file__).resolve().parent.parent


def fallthroughs(rec: dict) -> list[str]:
    """A recovery's fall-throughs from `pitstop status` JSON, each as the journal says it
    (`<path> <kind>: <detail>`); the typed parts are `path`, `kind` and `refusal`."""
    return [f"{f['path']} {f['kind'].replace('_', ' ')}: {f['refusal']['detail']}"
            for f in rec["fallthroughs"]]


def agent_config(tmp: Path, model: Path, **overrides: dict) -> dict:
    """A config for tests: ports chosen by the kernel, state under `tmp`, quick health."""
    cfg = {
        "engine": {"kind": "reference", "model": str(model), "device": "cpu"},
        "paths": {"state_dir": str(tmp / "state")},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "failures_before_restart": 3,
                   "start_timeout_s": 120},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def complete(agent: RunningAgent, prompt: str = "The snapshot") -> str:
    """A short greedy completion through the agent's front: the text it answered."""
    body = json.dumps({"model": agent.status_model(), "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(agent.front_url + "/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def snapshot_list(agent: RunningAgent) -> list[dict]:
    """`pitstop snapshot list --json` for the agent's configuration."""
    r = subprocess.run([sys.executable, "-m", "agent", "snapshot", "list", "--json", "--config",
                        str(agent.config_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Traffic:
    """Requests sent one after another from a thread while the block runs: each one's
    answer (or the exception it raised), when it was sent and when it was answered.

    Example::

        with Traffic(lambda: complete(agent)) as t:
            ...  # the agent snapshots, fails, recovers
        assert {a.said for a in t.answers} == {expected}
    """

    def __init__(self, ask: Callable[[], str]) -> None:
        self._ask = ask
        self._stop = threading.Event()
        self.answers: list[Answer] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                said: str | BaseException = self._ask()
            except Exception as e:  # noqa: BLE001 - every failure is an answer to report
                said = e
            self.answers.append(Answer(sent, time.monotonic(), said))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def spanning(self, moment: float) -> list[Answer]:
        """The answers to requests in flight at `moment` (time.monotonic())."""
        return [a for a in self.answers if a.sent <= moment <= a.answered]


@dataclasses.dataclass(frozen=True)
class Answer:
    sent: float
    answered: float
    said: str | BaseException


@contextlib.contextmanager
def held_agent(tmp: Path, model: Path) -> Iterator[tuple[RunningAgent, Holder]]:
    """A cpu-backend holder in `tmp/holder` and an agent whose engine keeps its weights in
    it, ready and with its first snapshot published; both stopped afterwards."""
    holder = Holder(tmp / "holder")
    a = RunningAgent(tmp, agent_config(
        tmp, model, holder={"enabled": True, "dir": str(tmp / "holder"), "gpu": "cpu"}))
    try:
        a.wait_ready()
        a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "the first snapshot")
        yield a, holder
    finally:
        a.stop()
        holder.stop()


# Every agent a test started and did not stop yet: `stop_all` ends them after each test, so a
# fixture that failed before its teardown leaves no agent, and so no engine, running.
_running: weakref.WeakSet[RunningAgent] = weakref.WeakSet()


def running() -> set[RunningAgent]:
    return set(_running)


def stop_all(keep: set[RunningAgent] | None = None) -> None:
    """Stop every running agent but those in `keep` (the agents of module-scoped fixtures,
    which were running before the test began and are their fixture's to stop)."""
    for agent in list(_running):
        if keep is None or agent not in keep:
            agent.stop()


def _scheme(access: dict | None) -> str:
    return "https" if access and access.get("tls") else "http"


class RunningAgent:
    """A `pitstop run` child process with its config, log and status file."""

    def __init__(self, tmp: Path, config: dict, env: dict[str, str] | None = None,
                 pitstop: Path | None = None) -> None:
        """`pitstop`: an installed `pitstop` command to run, from `tmp` (where the checkout's
        agent/ is not importable); by default this interpreter runs the checkout's."""
        self.tmp = tmp
        self.config = config
        self.config_path = tmp / "pitstop.yaml"
        self.write_config(config)
        self.log_path = tmp / "agent.log"
        self.status_path = Path(config["paths"]["state_dir"]) / "run" / "status.json"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the agent
        command = [str(pitstop)] if pitstop else [sys.executable, "-m", "agent"]
        self.proc = subprocess.Popen(
            [*command, "run", "--config", str(self.config_path)],
            cwd=tmp if pitstop else REPO, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        _running.add(self)

    def write_config(self, config: dict) -> None:
        self.config_path.write_text(yaml.safe_dump(config))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, text: str, timeout: float = 15) -> str:
        """The log once it has `text`. The engine's lines reach it through the agent, which
        relays them as they come: a line the engine wrote before an answer may be written
        here after the client has that answer."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the agent's log after {timeout} s:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.05)
        return log

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the log for a failure message, without the engine's access lines for
        the agent's own health checks (one a second: minutes of them hide what happened)."""
        kept = [line for line in self.log().splitlines() if '"GET /health' not in line]
        return "\n".join(kept)[-chars:]

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_for(self, pred, timeout: float = 120, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            # A status file left by an earlier agent on this state directory is not ours.
            if st and st.get("agent_pid") == self.proc.pid and pred(st):
                return st
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited ({self.proc.returncode}) waiting for {what}"
                                     f"\n{self.log_tail()}")
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; status {self.status()}"
                             f"\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 120, after_pid: int | None = None) -> dict:
        return self.wait_for(
            lambda s: s.get("state") == "ready" and s.get("engine_pid")
            and s.get("engine_pid") != after_pid, timeout, "ready")

    def wait_recovered(self, restarts: int, timeout: float = 120) -> dict:
        """Ready again after the `restarts`-th engine failure (a restore keeps the PID)."""
        return self.wait_for(lambda s: s.get("restarts") == restarts
                             and s.get("state") == "ready", timeout, f"recovery {restarts}")

    def status_model(self) -> str:
        return self.config["engine"].get("served_model_name") or \
            Path(self.config["engine"]["model"]).name

    @property
    def front_url(self) -> str:
        st = self.status()
        return f"{_scheme(st.get('front_access'))}://{st['front']}/v1"

    @property
    def metrics_url(self) -> str:
        st = self.status()
        return f"{_scheme(st.get('metrics_access'))}://{st['metrics']}/metrics"

    def metric(self, series: str) -> float:
        """One series' value as the agent exports it now, named as the exposition writes
        it: `name` or `name{label="value",...}` (labels in their declared order)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(series + " "):
                    return float(line.split()[1])
        raise AssertionError(f"no {series} in the agent's metrics")

    def pitstop(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A `pitstop` command (snapshot create, status...) on this agent's configuration."""
        return subprocess.run([sys.executable, "-m", "agent", *args, "--config",
                               str(self.config_path)], capture_output=True, text=True,
                              cwd=REPO, timeout=timeout)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _running.discard(self)
        # An agent that did not stop its engine (killed, or crashed) left a record of it; the
        # engine should have died with the agent, but a test must not leave one running.
        state = Path(self.config["paths"]["state_dir"])
        if not any(Path(a.config["paths"]["state_dir"]) == state for a in _running):
            EngineLedger(state).kill_leftovers()
        self._log.close()
        return self.proc.returncode
