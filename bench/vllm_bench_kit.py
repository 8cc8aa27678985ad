"""Parts of bench/vllm_gpu_bench.py: the time budget, the client's clock, the HF cache, rows."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from gpu_recovery_bench import REPO, log, machine, thp

if TYPE_CHECKING:
    from agent.engines.vllm.cli import VllmFeatures

PROMPT = "The license"
ANSWER_TOKENS = 8
# One request through the front may wait this long: the front holds it while the agent
# recovers, and a recovery that falls to a cold start of a 32 GiB model takes minutes.
ANSWER_LIMIT_S = 900.0


def add_vllm_args(ap: argparse.ArgumentParser) -> None:
    """Where vLLM runs: its interpreter, its packages, more environment for its processes."""
    ap.add_argument("--python", default=os.environ.get("PITSTOP_VLLM_PYTHON", sys.executable),
                    help="the interpreter that runs vLLM (engine.python)")
    ap.add_argument("--site", type=Path, default=None,
                    help="PYTHONPATH of vLLM's interpreter (an unpacked vLLM bundle)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="K=V",
                    help="more environment for every vLLM process (repeatable)")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Which model `pitstop make-model` makes, and how vLLM quantizes it."""
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3-moe"],
                    help="the model's architecture (make-model --arch)")
    from agent.modelgen import QUANTIZATIONS

    ap.add_argument("--quant", default="none", choices=list(QUANTIZATIONS),
                    help="a checkpoint pre-quantized so (make-model --quant)")
    ap.add_argument("--quantization", default=None,
                    help="vLLM's --quantization, on a checkpoint in the model's dtype (fp8)")


def model_kind(a: argparse.Namespace) -> dict[str, str]:
    """The row keys that say which model: `architecture`, and `quantization` as vLLM serves it
    (`none`; `fp8`: vLLM quantizes a bf16 checkpoint at load; `fp8-checkpoint`,
    `fp8-ct-checkpoint`, `w8a8-int8-checkpoint`, `awq-checkpoint`: the checkpoint is stored
    so)."""
    quant = a.quantization or (f"{a.quant}-checkpoint" if a.quant != "none" else "none")
    return {"architecture": a.arch, "quantization": quant}


def model_tag(a: argparse.Namespace) -> str:
    """`--gib` and the model's kind, as a file or folder name: `8gib`, `8gib-qwen3-moe`,
    `8gib-llama-fp8`."""
    kind = model_kind(a)
    if kind == {"architecture": "llama", "quantization": "none"}:
        return f"{a.gib:g}gib"
    return f"{a.gib:g}gib-{kind['architecture']}" + (
        "" if kind["quantization"] == "none" else f"-{kind['quantization']}")


def make_model_argv(a: argparse.Namespace) -> list[str]:
    return ["--target-gib", str(a.gib), "--arch", a.arch, "--quant", a.quant]


def engine_env(a: argparse.Namespace) -> dict[str, str]:
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /sleep and /wake_up
    if a.site:
        env["PYTHONPATH"] = str(a.site)
    for kv in a.engine_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def install_plugin(a: argparse.Namespace, where: Path) -> Path:
    """The Pitstop plugin for vLLM's interpreter, in a folder of its own (as on a node)."""
    plugin = where / "vllm-plugin"
    env = {**os.environ, **({"PYTHONPATH": str(a.site)} if a.site else {})}
    subprocess.run([str(REPO / "scripts" / "install-vllm-plugin.sh"), a.python,
                    str(plugin)], check=True, env=env)
    return plugin


def plugin_engine_env(a: argparse.Namespace, where: Path) -> tuple[dict[str, str], VllmFeatures]:
    """The environment of an engine that loads the Pitstop plugin (installed under `where`),
    and what vLLM it is."""
    from agent.engines.vllm.cli import read_features

    env = engine_env(a)
    features = read_features(a.python, {**os.environ, **env})
    plugin = install_plugin(a, where)
    env["PYTHONPATH"] = plugin_pythonpath(a, plugin)
    return env, features


def plugin_pythonpath(a: argparse.Namespace, plugin: Path) -> str:
    """vLLM's PYTHONPATH with the Pitstop plugin (installed in `plugin`) first."""
    return os.pathsep.join([str(plugin), *([str(a.site)] if a.site else [])])


@dataclass
class Budget:
    """The seconds this run may still take (--budget-s): a phase or a run that would not
    fit is skipped, and says so, rather than killed halfway by the caller's limit."""

    total_s: float | None
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        if self.total_s is None:
            return float("inf")
        return self.total_s - (time.monotonic() - self.started)

    def refuse(self, need_s: float, what: str) -> str | None:
        """Why `what` (about `need_s` seconds) is skipped; None when it fits."""
        left = self.left()
        if need_s <= left:
            return None
        why = f"{what} needs about {need_s:.0f} s, {max(left, 0):.0f} s of --budget-s left"
        log(f"skipped: {why}")
        return why


def http_call(addr: str, method: str, path: str, body: dict | None = None,
              timeout: float = 60.0) -> tuple[int, bytes]:
    """One HTTP call to host:port (the front, or a restored vLLM's own port)."""
    host, _, port = addr.rpartition(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over the engine's own Unix socket: sleep and wake go to vLLM, not the front."""

    def __init__(self, path: Path, timeout: float = 300.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def engine_call(sock: Path, method: str, path: str) -> tuple[int, bytes]:
    c = UnixHTTP(sock)
    try:
        c.request(method, path, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def write_config(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def set_subreaper(on: bool) -> None:
    """Orphans of this process's descendants come to it (to be reaped) while `on`."""
    ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def kill_tree(pids: list[int], limit_s: float = 60.0) -> None:
    """SIGKILL every one of `pids` and wait until they are gone (reaped when ours)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if not any(Path(f"/proc/{p}").exists() for p in pids):
            return
        time.sleep(0.01)


def tree_of(root: int) -> list[int]:
    """`root` and every process below it, from /proc's children lists (all threads)."""
    pids = [root]
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def answer(addr: str, model: str, timeout: float = ANSWER_LIMIT_S) -> str | None:
    """A fixed greedy completion through `addr`: its text, None when it did not complete."""
    try:
        status, body = http_call(addr, "POST", "/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "temperature": 0},
            timeout=timeout)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    try:
        return json.loads(body)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError):
        return None


def first_answer(addr: str, model: str, since: float, limit_s: float = ANSWER_LIMIT_S,
                 tries: list[int] | None = None) -> tuple[float | None, str | None]:
    """Ask until a request completes: (seconds from `since` to that answer, its text); a
    refused or cut request is asked again at once, as a client that retries would, with no
    pause of its own (the front holds a request while the engine is down, so a retry waits
    there, not in a spin): the figure is the agent's and the front's, not this loop's.
    `tries` gets the number of requests sent."""
    end = since + limit_s
    n = 0
    try:
        while time.monotonic() < end:
            n += 1
            text = answer(addr, model, timeout=max(1.0, end - time.monotonic()))
            if text is not None:
                return round(time.monotonic() - since, 3), text
        return None, None
    finally:
        if tries is not None:
            tries.append(n)


def serving_pid(engine_pid: int, proc: Path = Path("/proc")) -> int:
    """The engine's own serving process for the agent's `engine_pid`: itself; for an engine
    continued from a standby, the restored root two levels under the standby's init (its
    namespace's PID 1 between them); under Pitstop's small root (engine.small_root), the
    root's one child, vLLM's API server. A crash is that process dying; SIGKILL of the init
    or of the small root ends the engine too, but not as a crash of vLLM would."""
    from agent.checkpoint.standby import ns_root
    from agent.errors import SnapshotError

    pid = engine_pid
    try:
        if b"agent.checkpoint.nsinit" in (proc / str(pid) / "cmdline").read_bytes():
            pid = ns_root(pid, proc)
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        if any(a.endswith(b"deathsig.py") for a in argv) and b"--root" in argv:
            pid = int((proc / str(pid) / "task" / str(pid) / "children").read_text().split()[0])
    except (OSError, SnapshotError, IndexError, ValueError):
        pass
    return pid


def kill_to_answer(front: str, model: str, pid: int) -> dict:
    """SIGKILL the engine of the agent's `pid` (its API server: serving_pid) and time the
    next request through `front` that completes, as a client sees the recovery; the answer
    must be the one before the kill."""
    pid = serving_pid(pid)
    before = answer(front, model)
    # One more, timed: what an answer takes with nothing to recover (part of the figure).
    t = time.monotonic()
    answer(front, model)
    steady = round(time.monotonic() - t, 4)
    killed_at = time.time()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    tries: list[int] = []
    secs, after = first_answer(front, model, t0, tries=tries)
    return {"kill_to_answer_s": secs, "same_answer": after is not None and after == before,
            "answer_before": before, "answer_after": after, "killed_at": killed_at,
            "client_tries": tries[0], "steady_answer_s": steady}


def kill_breakdown(rec: dict, client: dict) -> dict[str, float] | None:
    """Where the seconds from the SIGKILL to the client's answer went, from the agent's
    `last_recovery` (wall-clock marks: `down_at`, when it saw the death; `lead_s`, what
    came before its decision; `at` and `duration_s`) and the client's kill and answer:
    `detect` (kill -> death seen), `teardown` (the dead tree killed and gone, its IDs
    free), `backoff`, `other` (the rest before the decision), `recovery` (the agent's
    own figure, decision -> verified canary), `front` (engine ready -> the client's
    answer: the held request released, sent, answered). None without the agent's marks
    (an agent older than them)."""
    secs, killed = client.get("kill_to_answer_s"), client.get("killed_at")
    if rec.get("down_at") is None or secs is None or killed is None:
        return None
    lead = rec.get("lead_s") or {}
    ready = rec["at"]
    decision = ready - rec["duration_s"]
    out = {"detect": rec["down_at"] - killed, "teardown": lead.get("teardown", 0.0),
           "backoff": lead.get("backoff", 0.0)}
    out["other"] = decision - rec["down_at"] - out["teardown"] - out["backoff"]
    out["recovery"] = rec["duration_s"]
    out["front"] = killed + secs - ready
    return {k: round(v, 4) for k, v in out.items()}


def gpu_used_bytes() -> int | None:
    """What nvidia-smi says GPU 0 has in use now (the baseline of a start's peak)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits", "-i", "0"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return int(out.stdout.strip()) << 20 if out.stdout.strip().isdigit() else None


def hf_cache(model: Path, root: Path, repo: str) -> tuple[str, dict[str, str]]:
    """A Hugging Face cache under `root` that holds `model` (symlinks, nothing copied) as
    `repo` at a 40-hex revision fixed by the model's files, as `vllm snapshot` wants a
    remote model at an immutable commit: (revision, the environment that reads it)."""
    h = hashlib.sha1(usedforsecurity=False)
    files = sorted(p for p in model.iterdir() if p.is_file())
    for p in files:
        h.update(f"{p.name} {p.stat().st_size}\n".encode())
    h.update((model / "config.json").read_bytes())
    rev = h.hexdigest()
    org, name = repo.split("/")
    base = root / "hub" / f"models--{org}--{name}"
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        link = snap / p.name
        if not link.is_symlink():
            link.symlink_to(p.resolve())
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(rev)
    return rev, {"HF_HOME": str(root), "HF_HUB_OFFLINE": "1"}


# The result keys whose records become rows: a record keeps the command of the call that
# measured it, since calls with other --paths add up in one JSON per size.
RECORD_KEYS = ("first_start_plain", "first_start_holder", "hybrid_first", "hybrid", "refill",
               "warm_first", "warm", "full_first", "full", "cold_first", "cold",
               "vllm_snapshot_first", "vllm_snapshot", "vllm_preload_first", "vllm_preload",
               "vllm_snapshot_manual", "sleep")


def stamp_records(result: dict, command: str) -> None:
    """Give every record not yet stamped this call's command."""
    for key in RECORD_KEYS:
        value = result.get(key)
        for rec in value if isinstance(value, list) else [value]:
            if isinstance(rec, dict):
                rec.setdefault("command", command)


def commands_of(recs: list[dict], default: str) -> str | list[str]:
    """The command that measured these records: one string, or each where calls differ."""
    seen = list(dict.fromkeys(r.get("command", default) for r in recs))
    return seen[0] if len(seen) == 1 else seen


def summarize(path: str, recs: list[dict], ctx: dict, time_key: str = "duration_s",
              rung: str | None = None) -> dict | None:
    """One result row for `path` from its runs (those that took the rung `rung`, by default
    `path`, and succeeded): the agent's own figure (`time_key`) and, beside it, the client's
    kill_to_answer_s."""
    ok = [r for r in recs if r.get("result", "success") == "success" and
          r.get("path", rung or path) == (rung or path) and r.get(time_key) is not None]
    if not ok:
        return None
    runs = [r[time_key] for r in ok]
    k2a = [r["kill_to_answer_s"] for r in ok if r.get("kill_to_answer_s") is not None]
    where, host = machine()
    stages: dict[str, list[float]] = {}
    for r in ok:
        for k, v in (r.get("stages") or {}).items():
            stages.setdefault(k, []).append(round(v, 3))
    return {"engine": "vllm", "path": path, "gib": ctx["gib"], "runs_s": runs,
            "median_s": round(statistics.median(runs), 3), "machine": where, "host": host,
            "command": commands_of(ok, ctx["command"]), "vllm_version": ctx.get("vllm_version"),
            "model": ctx.get("model"), "tp": ctx.get("tp", 1), "thp": thp(),
            **{k: ctx[k] for k in ("architecture", "quantization", "held_bytes", "eager",
                                   "small_root", "restore_log_level") if k in ctx},
            "kill_to_answer_s": k2a,
            "kill_to_answer_median_s": round(statistics.median(k2a), 3) if k2a else None,
            "same_answer": [r.get("same_answer") for r in ok if "same_answer" in r],
            "stages_median_s": {k: round(statistics.median(v), 3) for k, v in stages.items()},
            "kill_breakdown_median_s": median_parts([r.get("kill_breakdown") for r in ok]),
            "gpu_peak_bytes": [r.get("gpu_peak_bytes") for r in ok]}


def median_parts(items: list[dict | None]) -> dict[str, float]:
    """Each part's median over the runs that have it (kill_breakdown's)."""
    keys = dict.fromkeys(k for d in items if d for k in d)
    return {k: round(statistics.median(d[k] for d in items if d and k in d), 4) for k in keys}


def start_peaks(result: dict, ctx: dict) -> list[dict]:
    """The first start's peak GPU memory (the agent's NVML samples, every process on the
    GPU), plain and over the holder, and what the holder's start costs beyond the plain."""
    out = []
    plain, held = result.get("first_start_plain"), result.get("first_start_holder")
    for path, rec in (("first-start-plain", plain), ("first-start-holder", held)):
        if rec and rec.get("result") == "success":
            row = summarize(path, [{**rec, "path": path}], ctx)
            if row is not None:
                row.update(gpu_baseline_bytes=rec.get("gpu_baseline_bytes"),
                           gpu_peak_bytes=rec.get("gpu_peak_bytes"), what=rec.get("what"))
                out.append(row)
    if len(out) == 2 and all(r["gpu_peak_bytes"] for r in out):
        extra = out[1]["gpu_peak_bytes"] - out[0]["gpu_peak_bytes"]
        w = result.get("weights_bytes") or 0
        out[1].update(peak_over_plain_bytes=extra,
                      peak_over_plain_of_weights=round(extra / w, 3) if w else None)
    return out
