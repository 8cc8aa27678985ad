"""The soak's parts, shared by bench/soak.py and the CI-sized soak test: node, load, injector.

A `Node` is the real thing on this machine: `pitstop holder --backend cpu` and `pitstop run`
(front, supervisor, reference engine, CRIU snapshots) with the snapshot store on a small tmpfs
the node mounts itself, so that "the disk is full" is a real ENOSPC. `Load` runs clients
against the front (aiohttp streaming and whole, the official `openai` client) and compares
every answer with the uninterrupted one. `Injector` breaks one thing at a time and waits
until the node serves again, recording how it came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.commands import run as run_command  # noqa: E402
from agent.holder import protocol as hp  # noqa: E402
from agent.store import SnapshotStore  # noqa: E402

MODEL_NAME = "tiny"
# vLLM's CPU arguments the documented --engine vllm results were measured with (docs/
# reliability.md): the KV pool 0.1 of RAM, as the tests ran it then (they now give it in bytes).
VLLM_CPU_ARGS = ["--gpu-memory-utilization", "0.1", "--enforce-eager", "--max-model-len", "512"]
PROMPTS = ("Once upon a time", "The engine restarted and", "Pitstop keeps the weights",
           "A checkpoint is")


class Kind(enum.StrEnum):
    """One kind of failure the injector causes."""

    ENGINE_KILL = "engine_kill"        # SIGKILL of the engine
    ENGINE_CORE_KILL = "engine_core_kill"  # SIGKILL of vLLM's engine core (VLLM::EngineCore)
    ENGINE_HANG = "engine_hang"        # SIGSTOP of the engine: health checks time out
    HOLDER_KILL = "holder_kill"        # SIGKILL of the holder; restarted as systemd would
    DUMP_KILLED = "dump_killed"        # criu SIGKILLed while `pitstop snapshot create` runs
    DISK_FULL = "disk_full"            # the snapshot filesystem full; a snapshot and a crash
    IMAGE_FLIP = "image_flip"          # one byte of the newest image flipped, then a crash
    WEIGHTS_REWRITE = "weights_rewrite"  # a weights file rewritten: drift, regeneration
    AGENT_KILL = "agent_kill"          # SIGKILL of the agent, systemd restarts it


# How often each kind comes up in a mixed schedule: crashes are the common case, the kinds
# that need a fresh snapshot afterwards (a flip, a rewrite) are rarer and slower.
DEFAULT_MIX: dict[Kind, int] = {
    Kind.ENGINE_KILL: 45, Kind.ENGINE_HANG: 12, Kind.HOLDER_KILL: 8, Kind.DUMP_KILLED: 12,
    Kind.DISK_FULL: 8, Kind.IMAGE_FLIP: 8, Kind.WEIGHTS_REWRITE: 7,
}
# Real vLLM (CPU build, --engine vllm): no holder, so no holder kill; the engine core is a
# process of its own to kill; no weights rewrite (each one is a cold start of 25-75 s and a
# 3.6 GB snapshot, like the image flips, which stay).
VLLM_MIX: dict[Kind, int] = {
    Kind.ENGINE_KILL: 30, Kind.ENGINE_CORE_KILL: 20, Kind.ENGINE_HANG: 12,
    Kind.DUMP_KILLED: 14, Kind.DISK_FULL: 12, Kind.IMAGE_FLIP: 12,
}


def schedule(n: int, mix: dict[Kind, int], seed: int) -> list[Kind]:
    """`n` kinds in a shuffled order with the proportions of `mix`; every kind at least once
    when n allows."""
    total = sum(mix.values())
    kinds: list[Kind] = []
    for kind, w in mix.items():
        kinds += [kind] * max(1, round(n * w / total))
    rng = random.Random(seed)
    rng.shuffle(kinds)
    while len(kinds) < n:
        kinds.append(rng.choices(list(mix), weights=list(mix.values()))[0])
    return kinds[:n]


# --- the node ---------------------------------------------------------------------------
class Node:
    """The holder and `pitstop run` as child processes, the store on a tmpfs of `store_mib`."""

    def __init__(self, work: Path, model: Path, store_mib: int = 1024,
                 engine: str = "reference") -> None:
        self.work = work
        self.engine = engine
        # How long one engine start may take: vLLM on 2 shared cores takes 25-150 s.
        self.boot_s = 400.0 if engine == "vllm" else 180.0
        self.model = model
        # The tmpfs holds the store and, beside it, the filler of a disk-full injection.
        self.fs = work / "fs"
        self.store_dir = self.fs / "snapshots"
        self.holder_dir = work / "holder"
        self.config_path = work / "pitstop.yaml"
        self.status_path = work / "state" / "run" / "status.json"
        self.agent_log = work / "agent.log"
        self.holder_log = work / "holder.log"
        self.store_mib = store_mib
        self.agent: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self.holder_starts = 0

    def config(self) -> dict[str, Any]:
        if self.engine == "vllm":
            return self._vllm_config()
        return {
            "engine": {"kind": "reference", "model": str(self.model), "device": "cpu",
                       "served_model_name": MODEL_NAME, "args": ["--kv-slots", "8"]},
            "paths": {"state_dir": str(self.work / "state"),
                      "snapshot_dir": str(self.store_dir)},
            "front": {"host": "127.0.0.1", "port": 0, "max_resumes": 50,
                      "resume_wait_s": 120, "queue": {"deadline_s": 120}},
            "metrics": {"host": "127.0.0.1", "port": 0},
            "health": {"interval_s": 0.5, "timeout_s": 1.0, "failures_before_restart": 3,
                       "start_timeout_s": 120},
            "restart": {"backoff_initial_s": 0.0, "backoff_max_s": 1.0,
                        "crash_loop_limit": 100_000, "crash_loop_window_s": 1.0},
            "snapshots": {"keep": 2, "drift_check_interval_s": 1.0, "quiet_timeout_s": 10},
            "holder": {"enabled": True, "dir": str(self.holder_dir), "gpu": "cpu"},
        }

    def _vllm_config(self) -> dict[str, Any]:
        """Real vLLM as tests/test_agent_vllm.py runs it, with the KV pool of VLLM_CPU_ARGS:
        no holder (a crash comes back through the full restore), one after-serving snapshot
        (3.6 GB) kept."""
        sys.path.insert(0, str(ROOT))
        from tests.vllmproc import VLLM_PYTHON

        boot = self.boot_s
        return {
            "engine": {"kind": "vllm", "model": str(self.model), "python": str(VLLM_PYTHON),
                       "served_model_name": MODEL_NAME, "args": VLLM_CPU_ARGS,
                       "stop_timeout_s": 20},
            "paths": {"state_dir": str(self.work / "state"),
                      "snapshot_dir": str(self.store_dir)},
            "front": {"host": "127.0.0.1", "port": 0, "max_resumes": 50,
                      "resume_wait_s": boot, "queue": {"deadline_s": boot}},
            "metrics": {"host": "127.0.0.1", "port": 0},
            "health": {"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                       "start_timeout_s": boot},
            "restart": {"backoff_initial_s": 0.0, "backoff_max_s": 1.0,
                        "crash_loop_limit": 100_000, "crash_loop_window_s": 1.0},
            "snapshots": {"enabled": True, "regenerate": "after-serving", "keep": 1,
                          "quiet_timeout_s": 30},
        }

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.fs.mkdir(mode=0o700, exist_ok=True)
        run_command(["mount", "-t", "tmpfs", "-o", f"size={self.store_mib}m,mode=0700",
                     "pitstop-soak", str(self.fs)], timeout_s=30)
        self.store_dir.mkdir(mode=0o700)
        self.config_path.write_text(yaml.safe_dump(self.config()))
        if self.engine != "vllm":
            self.start_holder()
        self.start_agent()

    def start_holder(self) -> None:
        self.holder_starts += 1
        with open(self.holder_log, "ab") as log:
            self.holder = subprocess.Popen(
                [sys.executable, "-m", "agent", "holder", "--backend", "cpu", "--gpu", "cpu",
                 "--dir", str(self.holder_dir)], cwd=ROOT, stdout=log, stderr=log,
                stdin=subprocess.DEVNULL, start_new_session=True)
        sock = self.holder_dir / "cpu" / hp.SOCKET_NAME
        deadline = time.monotonic() + 60
        while not sock.exists():
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the holder did not come up: see {self.holder_log}")
            time.sleep(0.05)

    def start_agent(self) -> None:
        with open(self.agent_log, "ab") as log:
            self.agent = subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--config", str(self.config_path)],
                cwd=ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    async def wait_for(self, pred: Any, what: str,
                       timeout: float | None = None) -> dict[str, Any]:
        timeout = self.boot_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st and pred(st):
                return st
            if self.agent is not None and self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({self.agent.returncode}) waiting for "
                                   f"{what}; see {self.agent_log}")
            await asyncio.sleep(0.05)
        raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}: {self.status()}")

    async def ready(self, timeout: float | None = None) -> dict[str, Any]:
        return await self.wait_for(lambda s: s.get("state") == "ready" and s.get("engine_pid"),
                                   "the engine ready", timeout)

    def snapshot_create(self) -> subprocess.CompletedProcess[str]:
        r = run_command([sys.executable, "-m", "agent", "snapshot", "create", "--json",
                         "--config", str(self.config_path)], timeout_s=300, check=False,
                        cwd=ROOT)
        return subprocess.CompletedProcess(r.argv, r.returncode, r.stdout, r.stderr)

    def store(self) -> SnapshotStore:
        return SnapshotStore(self.store_dir)

    def log_text(self) -> str:
        return self.agent_log.read_text(errors="replace")

    def stop(self) -> None:
        for p in (self.agent, self.holder):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        with contextlib.suppress(Exception):
            run_command(["umount", "-l", str(self.fs)], timeout_s=30)


# --- the load ---------------------------------------------------------------------------
@dataclass
class Tally:
    """What the clients saw."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    wrong: int = 0
    worst_stall_s: float = 0.0
    by_client: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 50:
            self.failures.append(f"{time.strftime('%H:%M:%S')} {what}"[:500])


class Load:
    """Clients in a loop through the front, each answer compared with the uninterrupted one."""

    def __init__(self, base: str, max_tokens: int = 24) -> None:
        self.base = base  # http://host:port
        self.max_tokens = max_tokens
        self.refs: dict[tuple[str, str], str] = {}
        self.tally = Tally()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _body(self, api: str, prompt: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": self.max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": stream}
        if api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def references(self) -> None:
        """The answers before anything is broken (greedy decoding: deterministic)."""
        async with aiohttp.ClientSession() as s:
            for api in ("completions", "chat"):
                for prompt in PROMPTS:
                    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
                    async with s.post(self.base + path,
                                      json=self._body(api, prompt, False)) as r:
                        r.raise_for_status()
                        c = (await r.json())["choices"][0]
                    self.refs[api, prompt] = c["text"] if api != "chat" \
                        else c["message"]["content"]

    def start(self, aiohttp_clients: int = 2, openai_clients: int = 1) -> None:
        for i in range(aiohttp_clients):
            self._tasks.append(asyncio.create_task(self._aiohttp_client(i)))
        for i in range(openai_clients):
            self._tasks.append(asyncio.create_task(self._openai_client(i)))

    async def stop(self) -> Tally:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.tally

    def _check(self, client: str, api: str, prompt: str, text: str) -> None:
        t = self.tally
        t.by_client[client] += 1
        if text == self.refs[api, prompt]:
            t.ok += 1
        else:
            t.wrong += 1
            t.failures.append(f"wrong {client} {api} {prompt!r}: {text!r} != "
                              f"{self.refs[api, prompt]!r}"[:500])

    async def _aiohttp_client(self, i: int) -> None:
        n = 0
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while not self._stop.is_set():
                api = ("completions", "chat")[(n + i) % 2]
                stream = (n // 2 + i) % 2 == 0
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                name = f"aiohttp-{'stream' if stream else 'whole'}"
                self.tally.sent += 1
                try:
                    text = await self._one(s, api, prompt, stream)
                except Exception as e:  # noqa: BLE001 - every client failure is counted
                    self.tally.fail(f"{name} {api}: {type(e).__name__}: {e}")
                    continue
                if text is not None:
                    self._check(name, api, prompt, text)

    async def _one(self, s: aiohttp.ClientSession, api: str, prompt: str,
                   stream: bool) -> str | None:
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        t0 = time.monotonic()
        async with s.post(self.base + path, json=self._body(api, prompt, stream)) as r:
            if r.status != 200:
                self.tally.fail(f"{api} status {r.status}: {(await r.text())[:300]}")
                return None
            if not stream:
                c = (await r.json())["choices"][0]
                self._stall(time.monotonic() - t0)
                return c["text"] if api != "chat" else c["message"]["content"]
            buf, parts, last = b"", [], t0
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                self._stall(now - last)
                last = now
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    obj = json.loads(ev[6:])
                    if "error" in obj:
                        self.tally.fail(f"{api} stream error event: {obj['error']}")
                        return None
                    for c in obj.get("choices") or []:
                        parts.append(c.get("text") or (c.get("delta") or {}).get("content")
                                     or "")
            return "".join(parts)

    def _stall(self, seconds: float) -> None:
        self.tally.worst_stall_s = max(self.tally.worst_stall_s, seconds)

    async def _openai_client(self, i: int) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused",
                                    max_retries=0, timeout=600)
        n = i
        try:
            while not self._stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                stream = n % 2 == 0
                n += 1
                name = f"openai-{'stream' if stream else 'whole'}"
                self.tally.sent += 1
                t0 = time.monotonic()
                try:
                    extra = {"ignore_eos": True}
                    msgs = [{"role": "user", "content": prompt}]
                    if stream:
                        parts, last = [], t0
                        resp = await client.chat.completions.create(
                            model=MODEL_NAME, messages=msgs, max_tokens=self.max_tokens,
                            temperature=0, stream=True, extra_body=extra)
                        async for ev in resp:
                            now = time.monotonic()
                            self._stall(now - last)
                            last = now
                            for c in ev.choices:
                                parts.append(c.delta.content or "")
                        text = "".join(parts)
                    else:
                        out = await client.chat.completions.create(
                            model=MODEL_NAME, messages=msgs, max_tokens=self.max_tokens,
                            temperature=0, extra_body=extra)
                        self._stall(time.monotonic() - t0)
                        text = out.choices[0].message.content or ""
                except Exception as e:  # noqa: BLE001 - every client failure is counted
                    self.tally.fail(f"{name}: {type(e).__name__}: {e}")
                    continue
                self._check(name, "chat", prompt, text)
        finally:
            await client.close()


# --- the injector -----------------------------------------------------------------------
@dataclass
class Injection:
    """One failure caused and how the node came back from it."""

    n: int
    kind: str
    at: float
    ok: bool
    seconds: float  # from the injection until the node serves again
    path: str = ""  # the rung that brought the engine back, when the engine was replaced
    recovery_s: float | None = None  # the agent's own figure for that recovery
    note: str = ""


@dataclass
class Books:
    """The soak's own accounting of snapshots: what was good, what the injector spoiled."""

    good: dict[str, int] = field(default_factory=dict)  # id -> bytes, verified intact
    spoiled: set[str] = field(default_factory=set)  # ids whose image the injector changed
    # Ids made stale by an injection (a new holder, new weights): rightly never restored
    # again, and rightly pruned.
    stale: set[str] = field(default_factory=set)
    lost: list[str] = field(default_factory=list)
    bad_restored: list[str] = field(default_factory=list)


_RESTORED = re.compile(r"restored snapshot (\S+) as PID")


class Injector:
    """Causes one failure at a time on a `Node` and waits until it serves again."""

    def __init__(self, node: Node, seed: int = 0) -> None:
        self.node = node
        self.rng = random.Random(seed)
        self.books = Books()
        self.done: list[Injection] = []
        self._log_offset = 0
        self.weights_version = 0

    async def settled(self, quiet_s: float = 0.3) -> dict[str, Any]:
        """Ready, and not just become so: a snapshot after a cold start begins at once, and a
        SIGSTOP during a dump is taken by CRIU's ptrace, not by the engine."""
        return await self.node.wait_for(
            lambda s: s.get("state") == "ready" and s.get("engine_pid")
            and time.time() - s.get("state_since", time.time()) >= quiet_s, "settled")

    async def inject(self, kind: Kind) -> Injection:
        st = await self.settled()
        t0 = time.monotonic()
        at = time.time()
        handler = getattr(self, f"_{kind.value}")
        note = await handler(st) or ""
        after = await self.node.wait_for(
            lambda s: s.get("state") == "ready" and s.get("engine_pid"), "ready again")
        rec = after.get("last_recovery") or {}
        # A restore keeps the engine's PID: a recovery is told by its own timestamp.
        replaced = rec.get("at", 0) >= at
        inj = Injection(n=len(self.done) + 1, kind=kind.value, at=at, ok=True,
                        seconds=round(time.monotonic() - t0, 3),
                        path=rec.get("path", "") if replaced else "",
                        recovery_s=rec.get("duration_s") if replaced else None, note=note)
        self._audit()
        self.done.append(inj)
        return inj

    def failed(self, kind: Kind, why: str) -> None:
        """An injection the node did not come back from as it must (counted, kept)."""
        self.done.append(Injection(n=len(self.done) + 1, kind=kind.value, at=time.time(),
                                   ok=False, seconds=0.0, note=why[:500]))

    # Each handler breaks one thing and returns once the breakage is in place (a note).
    async def _engine_kill(self, st: dict[str, Any]) -> str:
        pid = st["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        await self._replaced(st)
        return f"killed {pid}"

    async def _engine_core_kill(self, st: dict[str, Any]) -> str:
        from agent import proc

        cores = [pid for pid in proc.descendants(st["engine_pid"])
                 if "EngineCore" in _cmd0(pid)]
        if len(cores) != 1:
            raise RuntimeError(f"want one EngineCore under {st['engine_pid']}: {cores}")
        os.kill(cores[0], signal.SIGKILL)
        await self._replaced(st)
        return f"engine core {cores[0]} killed"

    async def _engine_hang(self, st: dict[str, Any]) -> str:
        pid = st["engine_pid"]
        os.kill(pid, signal.SIGSTOP)
        while True:
            try:
                await self._replaced(st, timeout=15)
                return f"stopped {pid}"
            except RuntimeError:
                # A snapshot that began meanwhile took the stop (CRIU seizes the engine
                # with ptrace); the engine ran on. Stop it again.
                # (Gone: the agent replaced it, by a slower rung than 15 s.)
                if _proc_state(pid) not in ("T", "t", ""):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)

    async def _holder_kill(self, st: dict[str, Any]) -> str:
        h = self.node.holder
        assert h is not None
        h.kill()
        h.wait()
        # systemd's Restart=always: the new holder is empty and has another id.
        await asyncio.to_thread(self.node.start_holder)
        self._stale("hybrid")
        return f"holder {h.pid} killed and restarted"

    async def _dump_killed(self, st: dict[str, Any]) -> str:
        before = set(self.node.store().ids())
        create = asyncio.create_task(asyncio.to_thread(self.node.snapshot_create))
        criu = None
        deadline = time.monotonic() + 120
        while criu is None and not create.done() and time.monotonic() < deadline:
            criu = _criu_dump_pid(self.node.store_dir)
            await asyncio.sleep(0.005)
        if criu is not None:
            await asyncio.sleep(self.rng.uniform(0.0, 0.15))
            with contextlib.suppress(ProcessLookupError):
                os.kill(criu, signal.SIGKILL)
        r = await create
        after = set(self.node.store().ids())
        published = after - before
        if r.returncode == 0 and criu is not None:
            # The kill came after the dump had finished: a published snapshot must verify.
            return f"criu {criu} killed too late; published {sorted(published)}"
        if criu is None:
            return f"no criu seen (create exited {r.returncode})"
        if published:
            raise AssertionError(f"an interrupted dump published {sorted(published)}")
        return f"criu {criu} killed; create exited {r.returncode}"

    async def _disk_full(self, st: dict[str, Any]) -> str:
        filler = self.node.fs / "filler"
        stat = os.statvfs(self.node.store_dir)
        free = stat.f_bavail * stat.f_frsize
        await asyncio.to_thread(fill_until_full, filler)
        try:
            r = await asyncio.to_thread(self.node.snapshot_create)
            if r.returncode == 0:
                raise AssertionError(f"a snapshot was published onto a full disk: {r.stdout}")
            # A crash while the disk is full: the restore must not need to write there.
            st = self.node.status()
            await self._engine_kill(st)
            await self.node.ready()
        finally:
            filler.unlink(missing_ok=True)
        return f"{free >> 20} MiB filled; create exited {r.returncode}"

    async def _image_flip(self, st: dict[str, Any]) -> str:
        entries = [e for e in self.node.store().entries()  # newest first
                   if e.manifest is not None and e.id not in self.books.spoiled]
        if not entries:
            return "no snapshot to flip"
        sid = entries[0].id
        files = sorted(p for p in (self.node.store_dir / sid).rglob("*")
                       if p.is_file() and p.suffix == ".img" and p.stat().st_size > 0)
        victim = self.rng.choice(files)
        offset = self.rng.randrange(victim.stat().st_size)
        with open(victim, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
        self.books.spoiled.add(sid)
        self.books.good.pop(sid, None)
        await self._engine_kill(self.node.status())
        # The agent quarantines the refused image; the store keeps the newest
        # snapshots.quarantine_keep of them within the disk budget. Clear it all the same, so
        # that the soak's disk use does not depend on that setting (as before it existed).
        for q in (self.node.store_dir / ".quarantine").glob(f"{sid}.*"):
            shutil.rmtree(q, ignore_errors=True)
        return f"{sid}/{victim.name}@{offset}"

    async def _weights_rewrite(self, st: dict[str, Any]) -> str:
        self.weights_version += 1
        target = _rewrite_weights(self.node.model, self.weights_version)
        self._stale()
        # Drift is noticed within drift_check_interval_s; the engine is replaced when quiet.
        await self._replaced(st, timeout=240)
        return f"{target.name} rewritten (version {self.weights_version})"

    async def _replaced(self, st: dict[str, Any], timeout: float | None = None) -> None:
        since = (st.get("last_recovery") or {}).get("at", 0)
        await self.node.wait_for(
            lambda s: (s.get("last_recovery") or {}).get("at", 0) > since
            and s.get("state") == "ready", "the engine replaced", timeout)

    # -- the books --------------------------------------------------------------------
    def _stale(self, kind: str | None = None) -> None:
        for e in self.node.store().entries():
            if kind is None or (e.manifest is not None and e.manifest.kind == kind):
                self.books.stale.add(e.id)
                self.books.good.pop(e.id, None)

    def _audit(self) -> None:
        """Snapshots restored since the last audit (none spoiled), and none good lost."""
        text = self.node.log_text()
        fresh, self._log_offset = text[self._log_offset:], len(text)
        for sid in _RESTORED.findall(fresh):
            if sid in self.books.spoiled:
                self.books.bad_restored.append(sid)
        store = self.node.store()
        ids = set(store.ids())
        keep = self.node.config()["snapshots"]["keep"]
        for sid in list(self.books.good):
            if sid not in ids:
                # Retention removes the oldest once `keep` newer ones are published.
                newer = [i for i in ids if i > sid and i not in self.books.spoiled]
                if len(newer) < keep:
                    self.books.lost.append(f"{sid}: removed with {len(newer)} newer")
                del self.books.good[sid]
        for sid in ids - set(self.books.good) - self.books.spoiled - self.books.stale:
            v = store.verify(sid)
            if v.ok:
                self.books.good[sid] = 1

    def final_audit(self) -> None:
        """Every snapshot still counted good verifies now."""
        store = self.node.store()
        for sid in list(self.books.good):
            if sid in set(store.ids()) and not store.verify(sid).ok:
                self.books.lost.append(f"{sid}: no longer verifies")


def _cmd0(pid: int) -> str:
    """A process's title (argv[0]) and name: vLLM's engine core says EngineCore in both."""
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                + " " + Path(f"/proc/{pid}/comm").read_text().strip())
    except OSError:
        return ""


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _criu_dump_pid(store_dir: Path) -> int | None:
    """The `criu dump` writing into this node's store: never another one on the machine."""
    prefix = os.fsencode(store_dir)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # `make criu`'s wrapper execs CRIU through its own ld.so: argv[0] is not criu.
        if (b"dump" in cmd and any(c.endswith(b"/criu") or c == b"criu" for c in cmd[:5])
                and any(c.startswith(prefix) for c in cmd)):
            return int(d.name)
    return None


def fill_until_full(path: Path) -> None:
    """Write zeros to `path` until its filesystem has no byte left.

    Unbuffered: a buffered file keeps the tail of a short write (up to its 8 KiB buffer) and
    raises ENOSPC again when the `with` closes it, so a fill whose free space ended within 8 KiB
    of a MiB failed (once in a CI soak)."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(chunk):
                pass
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def _rewrite_weights(model: Path, version: int) -> Path:
    """Rewrite the model's safetensors file with another header metadata value: its digest
    changes (drift), the tensors and so the answers do not."""
    target = sorted(model.glob("*.safetensors"))[0]
    data = target.read_bytes()
    (n,) = __import__("struct").unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.setdefault("__metadata__", {})["soak"] = str(version)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(__import__("struct").pack("<Q", len(head)) + head + data[8 + n:])
    os.replace(tmp, target)
    return target


def summary(injections: list[Injection], tally: Tally, books: Books,
            holder_restarts: int, agent_restarts: int) -> dict[str, Any]:
    """The soak's totals, as the result JSON carries them."""
    paths: dict[str, list[float]] = {}
    for inj in injections:
        if inj.path and inj.recovery_s is not None:
            paths.setdefault(inj.path, []).append(inj.recovery_s)
    return {
        "failures_injected": len(injections),
        "injections_not_recovered": sum(not i.ok for i in injections),
        "by_kind": dict(Counter(i.kind for i in injections)),
        "requests_sent": tally.sent, "requests_ok": tally.ok,
        "requests_failed": tally.failed, "requests_wrong": tally.wrong,
        "worst_stall_s": round(tally.worst_stall_s, 3),
        "good_snapshots_lost": len(books.lost), "bad_snapshots_restored":
            len(books.bad_restored),
        "holder_restarts": holder_restarts, "agent_restarts": agent_restarts,
        "recoveries": {p: stats(v) for p, v in sorted(paths.items())},
        "failure_samples": tally.failures[:20], "lost": books.lost,
        "bad_restored": books.bad_restored,
    }


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)

    def q(x: float) -> float:
        return v[min(len(v) - 1, int(x * len(v)))]

    return {"n": len(v), "p50_s": round(q(0.5), 3), "p99_s": round(q(0.99), 3),
            "max_s": round(v[-1], 3)}


def injections_json(injections: list[Injection]) -> list[dict[str, Any]]:
    return [asdict(i) for i in injections]


