"""CUDA vLLM under the real agent on a GPU: cold start, full and hybrid restore, warm start and
vLLM's own sleep/wake.

On the GPU host, from the repository root, with a CUDA vLLM importable from --site:

    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/vllm_gpu_bench.py OUT --gib 8 \\
        --site /tmp/vsite

One run measures, on one model of --gib GiB (`pitstop make-model --target-gib`, in
/dev/shm), side by side:

- **cold**: `pitstop run` with `engine.kind: vllm` starts vLLM from nothing (import, weights,
  torch.compile from vLLM's compile cache, CUDA graphs, KV pool) to the verified canary: the
  first start of agent A, then agent B (snapshots off) started and its API server SIGKILLed
  until --runs cold starts were seen.
- **full**: agent A, snapshots on, takes its after-serving snapshot (CUDA checkpoint of every
  process of the tree holding a CUDA context, CRIU dump), then its API server is SIGKILLed
  --runs times; each recovery is a full restore (CRIU restore, CUDA restore, canary). A
  recovery that falls through to a cold start (the restore failed: its reason is in the
  record's fallthroughs) ends the series and counts as a cold start.
- **hybrid**: agent C, with a holder (`pitstop holder`, cuda backend, started here) and the
  Pitstop plugin installed for vLLM's interpreter (`scripts/install-vllm-plugin.sh`, into a
  folder put first on the engine's PYTHONPATH): the first start loads the weights into the
  holder (`--load-format pitstop`), the after-serving snapshot is a hybrid one (the weights
  detached and the KV pool released by the worker extension, vLLM's sleep mode), then
  --runs SIGKILLs, each recovery a hybrid restore (CRIU restore of the small image, CUDA
  restore, the held weights mapped again at their addresses, the KV pool re-made, canary).
- **warm**: agent C's engine once more, snapshots off: a fresh vLLM whose loader maps the
  held weights instead of reading the files, --warm-runs times.
- **sleep**: vLLM's own sleep level 1 and wake_up (`VLLM_SERVER_DEV_MODE=1`) on agent B's
  first engine, --runs times, each checked by the same greedy answer: the in-process
  reference a restore can approach. Agent B's engines run with `--enable-sleep-mode` (vLLM's
  CuMemAllocator); agent A's do not, so the snapshot is of the engine a user runs by default.

Every engine gets --max-model-len at most the model's max_position_embeddings and a KV pool
of --kv-gib by `--kv-cache-memory-bytes` (the image then holds the weights plus a pool of the
same size at every model size, and fits the disk at 32 GiB). Recovery figures are the agent's
own `last_recovery` (decision to restart -> verified canary) with its stages; the snapshot's
timings and image size come from its manifest. Writes OUT/vllm-gpu-<gib>gib.json (rows in the
result-row format) after every phase, so a run cut short still returns what it measured, and
copies the agents' logs to OUT.

`--device cpu` is a dry run of the script against vLLM's CPU build on the tests' tiny Llama
(no sleep mode there: use `--paths cold,full`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_recovery_bench import (  # noqa: E402
    Agent,
    first_snapshot,
    gpu_id,
    log,
    machine,
    recover,
    start_holder,
    stop_holder,
)

from agent.engines.vllm.cli import FLASHINFER_SAMPLER, VllmFeatures, read_features  # noqa: E402
from agent.modelgen import make_model, record_for, spec_for  # noqa: E402

IO_URING = Path("/proc/sys/kernel/io_uring_disabled")
BOOT_S = 900
# A full image holds the weights, the KV pool and about this much more (CUDA context, torch
# and vLLM's host memory, vLLM's shared-memory rings): 4.0 GB at 8 GiB in the hand-run recipe.
IMAGE_OVERHEAD_BYTES = 8 << 30
COMPILE_CACHE = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
PROMPT = "The license"


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over the engine's Unix socket: sleep/wake go to vLLM itself, not the front."""

    def __init__(self, path: Path, timeout: float = 300.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def engine_call(sock: Path, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    c = UnixHTTP(sock)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def greedy(sock: Path, model: str) -> list[int] | str:
    """A fixed greedy completion's token ids (its error text when it fails)."""
    status, body = engine_call(sock, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
        "return_token_ids": True})
    if status != 200:
        return body[:300].decode(errors="replace")
    choice = json.loads(body)["choices"][0]
    return choice.get("token_ids") or choice["text"]


def sleep_wake(sock: Path, model: str, runs: int) -> list[dict]:
    """vLLM's own sleep (level 1: weights to host memory, KV pool dropped) and wake_up, each
    followed by the greedy answer, which must equal the one before the first sleep."""
    before = greedy(sock, model)
    out = []
    for n in range(1, runs + 1):
        t0 = time.monotonic()
        s1, b1 = engine_call(sock, "POST", "/sleep?level=1")
        t1 = time.monotonic()
        # A vLLM without sleep mode answers /sleep 200 and does nothing: ask.
        _, asleep = engine_call(sock, "GET", "/is_sleeping")
        t1b = time.monotonic()
        s2, b2 = engine_call(sock, "POST", "/wake_up")
        t2 = time.monotonic()
        answer = greedy(sock, model)
        t3 = time.monotonic()
        r = {"sleep_s": round(t1 - t0, 3), "wake_s": round(t2 - t1b, 3),
             "first_answer_s": round(t3 - t2, 3), "wake_to_answer_s": round(t3 - t1b, 3),
             "status": [s1, s2], "asleep": _is_sleeping(asleep), "same_answer": answer == before}
        if (s1, s2) != (200, 200):
            r["error"] = (b1 if s1 != 200 else b2)[:300].decode(errors="replace")
        log(f"sleep/wake {n}: {r}")
        out.append(r)
        if "error" in r:
            break
    return out


def started(st: dict) -> bool:
    """The first start is over: the agent may already be snapshotting (within milliseconds
    of ready, too quick to poll)."""
    rec = st.get("last_recovery") or {}
    return rec.get("result") == "success" and st.get("state") in ("ready", "snapshotting")


def _is_sleeping(body: bytes) -> bool:
    try:
        return bool(json.loads(body).get("is_sleeping"))
    except (ValueError, AttributeError):
        return False


def compile_cache_entries() -> int:
    d = COMPILE_CACHE / "torch_compile_cache"
    return sum(1 for _ in d.rglob("*")) if d.is_dir() else 0


def model_dir(a: argparse.Namespace) -> Path:
    if a.device == "cpu":
        spec = spec_for("tiny", seed=0)
        key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode())
        d = REPO / ".cache" / "models" / f"tiny-{key.hexdigest()[:16]}"
        make_model(d, spec)
        return d
    d = a.models / f"{a.gib:g}"
    # make-model leaves a complete model alone; a warm machine reuses the last call's.
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(d), "--target-gib",
                    str(a.gib)], cwd=REPO, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": a.device})
    return d


def engine_args(model: Path, a: argparse.Namespace, sleep_mode: bool) -> list[str]:
    c = json.loads((model / "config.json").read_text())
    # vLLM refuses a --max-model-len above the model's max_position_embeddings (2048 for
    # make-model's): the derived maximum is the longest the model was built for.
    max_len = min(a.max_len, c["max_position_embeddings"])
    if a.device == "cpu":
        return ["--gpu-memory-utilization", "0.1", "--enforce-eager", "--max-model-len",
                str(min(max_len, 512))]
    # The KV pool by size, not as a fraction of the GPU: the image then holds the weights
    # plus a pool that is the same at every model size (and fits the disk at 32 GiB).
    # vLLM still checks at start that this fraction of the GPU is free; 0.6 leaves room for
    # a CUDA context that a killed engine has not yet given back.
    return ["--max-model-len", str(max_len), "--kv-cache-memory-bytes",
            str(int(a.kv_gib * (1 << 30))), "--gpu-memory-utilization", "0.6",
            "--max-num-seqs", "16", *(["--enable-sleep-mode"] if sleep_mode else [])]


def engine_env(a: argparse.Namespace) -> tuple[dict[str, str], VllmFeatures]:
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /sleep and /wake_up
    if a.site:
        env["PYTHONPATH"] = str(a.site)
    f = read_features(a.python, {**os.environ, **env})
    # A vLLM carried without its dependencies (the device's bundle) lacks flashinfer, which
    # the default CUDA sampler imports (`pitstop doctor` says the same).
    if f.cuda_build and f.flashinfer is False:
        env[FLASHINFER_SAMPLER] = "0"
    return env, f


def image_on_disk(snapshot_dir: Path, sid: str) -> int:
    """Bytes the image takes on disk (vLLM's shared-memory rings are saved sparse)."""
    return sum(p.stat().st_blocks * 512 for p in (snapshot_dir / sid).rglob("*") if p.is_file())


def _mem_available() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_disk(where: Path, need: int) -> dict:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < need:
        raise SystemExit(f"{where} has {free / 1e9:.1f} GB free, a full image needs about "
                         f"{need / 1e9:.1f} GB: lower --kv-gib or give --snapshot-dir on a "
                         "bigger file system")
    return {"dir": str(where), "free_bytes": free, "needed_bytes": need}


def summarize(path: str, recs: list[dict], gib: float, command: str) -> dict | None:
    # A recovery that fell through to another path is not a run of this one.
    ok = [r for r in recs if r.get("result") == "success" and r.get("path") == path]
    if not ok:
        return None
    runs = [r["duration_s"] for r in ok]
    where, host = machine()
    stages: dict[str, list[float]] = {}
    for r in ok:
        for k, v in r.get("stages", {}).items():
            stages.setdefault(k, []).append(round(v, 3))
    return {"engine": "vllm", "path": path, "gib": gib, "runs_s": runs,
            "median_s": round(statistics.median(runs), 3), "min_s": min(runs),
            "max_s": max(runs), "machine": where, "host": host, "command": command,
            "stages_s": stages,
            "stages_median_s": {k: round(statistics.median(v), 3) for k, v in stages.items()}}


def sleep_row(recs: list[dict], gib: float, command: str) -> dict | None:
    ok = [r for r in recs if r["status"] == [200, 200] and r["asleep"] and r["same_answer"]]
    if not ok:
        return None
    where, host = machine()
    runs = [r["wake_to_answer_s"] for r in ok]
    return {"engine": "vllm", "path": "sleep-wake", "gib": gib, "runs_s": runs,
            "median_s": round(statistics.median(runs), 3), "min_s": min(runs),
            "max_s": max(runs), "machine": where, "host": host, "command": command,
            "what": "vLLM's own wake_up (level 1) to the first greedy answer, process alive",
            "wake_s": [r["wake_s"] for r in ok], "sleep_s": [r["sleep_s"] for r in ok]}


def install_plugin(a: argparse.Namespace, where: Path) -> Path:
    """The Pitstop plugin for vLLM's interpreter, in a folder of its own (as on a node)."""
    plugin = where / "vllm-plugin"
    env = {**os.environ, **({"PYTHONPATH": str(a.site)} if a.site else {})}
    subprocess.run([str(REPO / "scripts" / "install-vllm-plugin.sh"), a.python, str(plugin)],
                   check=True, env=env)
    return plugin


def holder_phase(result: dict, cfg: dict, a: argparse.Namespace, model: Path, work: Path,
                 save: Callable[[], None]) -> None:
    """Agent C over a holder: its first start fills the holder, then hybrid restores; then
    warm starts (snapshots off, the holder still holding the weights)."""
    c = work / "hybrid"
    c.mkdir()
    plugin = install_plugin(a, c)
    gpu = gpu_id(a.device)
    holder = start_holder(gpu, c / "holder", c)
    env = dict(cfg["engine"]["env"])
    env["PYTHONPATH"] = os.pathsep.join([str(plugin), *([str(a.site)] if a.site else [])])
    ccfg = {**cfg, "engine": {**cfg["engine"], "socket": str(c / "engine.sock"), "env": env},
            "holder": {"enabled": True, "dir": str(c / "holder"), "gpu": gpu},
            "paths": {"state_dir": str(c / "state")},
            "snapshots": {**cfg["snapshots"], "enabled": "hybrid" in a.paths.split(",")}}
    result["engine_env_hybrid"] = env
    try:
        if ccfg["snapshots"]["enabled"]:
            agent = Agent(ccfg, c)
            try:
                st = agent.wait(started, BOOT_S, "agent C's first start (weights into the holder)")
                result["holder_first"] = st["last_recovery"]
                log(f"first start over the holder {st['last_recovery']}")
                save()
                snap = first_snapshot(agent)
                snap["image_on_disk_bytes"] = image_on_disk(c / "state" / "snapshots",
                                                            snap["id"])
                result["hybrid_snapshot"] = snap
                save()
                if snap.get("kind") != "hybrid":
                    log(f"the snapshot is {snap.get('kind')}, not hybrid: see agent-hybrid log")
                    return
                result["hybrid"] = []
                for n in range(1, a.runs + 1):
                    rec = recover(agent, n, a.steady_requests)
                    result["hybrid"].append(rec)
                    save()
                    if rec["path"] != "hybrid":
                        log(f"recovery {n} went {rec['path']}: {rec['fallthroughs']}")
                        break
            finally:
                agent.stop()
        if "warm" in a.paths.split(","):
            wcfg = {**ccfg, "snapshots": {**ccfg["snapshots"], "enabled": False}}
            agent = Agent(wcfg, c)
            try:
                result["warm"] = []
                st = agent.wait(started, BOOT_S, "agent C's start with snapshots off")
                rec, n = st["last_recovery"], 0
                if rec["path"] != "warm":
                    # No earlier phase filled the holder: this start did.
                    result.setdefault("holder_first", rec)
                    n, rec = 1, recover(agent, 1, 0)
                while True:
                    result["warm"].append(rec)
                    log(f"warm start {len(result['warm'])}: {rec['path']} "
                        f"{rec['duration_s']:.2f} s {rec['stages']} {rec.get('fallthroughs')}")
                    save()
                    if rec["path"] != "warm" or len(result["warm"]) >= a.warm_runs:
                        break
                    n += 1
                    rec = recover(agent, n, 0)
            finally:
                agent.stop()
    finally:
        stop_holder(holder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=2.0, help="the KV pool, in GiB")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--paths", default="cold,full,sleep")
    ap.add_argument("--python", default=os.environ.get("PITSTOP_VLLM_PYTHON", sys.executable),
                    help="the interpreter that runs vLLM (engine.python)")
    ap.add_argument("--site", type=Path, default=None,
                    help="PYTHONPATH for vLLM's interpreter (an unpacked vLLM bundle)")
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/models"))
    ap.add_argument("--work", type=Path, default=Path("/root/pitstop-vllm-bench"))
    ap.add_argument("--snapshot-dir", type=Path, default=None,
                    help="default: on disk under --work")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run on vLLM's CPU build")
    ap.add_argument("--steady-requests", type=int, default=2)
    ap.add_argument("--warm-runs", type=int, default=1,
                    help="warm starts (each a fresh vLLM over the held weights)")
    a = ap.parse_args()
    paths = a.paths.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.gib:g}gib" if a.device != "cpu" else "tiny"
    command = " ".join(["python3", "bench/vllm_gpu_bench.py", *sys.argv[1:]])
    result: dict = {"gib": a.gib, "runs": a.runs, "kv_gib": a.kv_gib, "paths": paths,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out_json = a.out / f"vllm-gpu-{tag}.json"

    def save() -> None:
        rows = [summarize("cold", result.get("cold", []), a.gib, command),
                summarize("full", result.get("full", []), a.gib, command),
                summarize("hybrid", result.get("hybrid", []), a.gib, command),
                summarize("warm", result.get("warm", []), a.gib, command),
                sleep_row(result.get("sleep", []), a.gib, command)]
        for r in rows:
            snap = result.get({"full": "snapshot", "hybrid": "hybrid_snapshot"}.get(
                r["path"], "") if r else "")
            if r and snap:
                r["image_bytes"] = snap["image_bytes"]
        result["rows"] = [r for r in rows if r]
        out_json.write_text(json.dumps(result, indent=1) + "\n")
        # The agents' logs too, each time: a run stopped by its time limit keeps them.
        for log_file, name in ((work / "agent.log", "agent"),
                               (work / "cold" / "agent.log", "agent-cold"),
                               (work / "hybrid" / "agent.log", "agent-hybrid"),
                               (work / "hybrid" / "holder.log", "holder")):
            with contextlib.suppress(OSError):
                shutil.copy(log_file, a.out / f"{name}-{tag}.log")

    work = a.work / tag
    t0 = time.monotonic()
    model = model_dir(a)
    result["make_model_s"] = round(time.monotonic() - t0, 2)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    result["weights_bytes"] = weights
    if a.device == "cpu":
        a.gib = round(weights / (1 << 30), 4)
    log(f"model {model}: {weights / 1e9:.2f} GB ({result['make_model_s']} s)")
    result["memory"] = {"shm_free_bytes": shutil.disk_usage("/dev/shm").free,
                        "ram_available_bytes": _mem_available()}

    # Disk: the images of an earlier size go first (a 32 GiB image and an 8 GiB one do not
    # both fit the device's 64 GiB disk).
    if a.work.exists():
        for old in a.work.iterdir():
            shutil.rmtree(old, ignore_errors=True)
    work.mkdir(parents=True)
    snap_dir = a.snapshot_dir or work / "state" / "snapshots"
    if a.snapshot_dir:
        shutil.rmtree(a.snapshot_dir, ignore_errors=True)
    need = weights + int(a.kv_gib * (1 << 30)) + IMAGE_OVERHEAD_BYTES
    result["disk"] = check_disk(snap_dir.parent, need if "full" in paths else 0)
    sock = work / "engine.sock"
    env, features = engine_env(a)
    result["vllm"] = features.describe()
    log(f"vLLM: {features.describe()}; engine env {env}")
    cfg = {
        "engine": {"kind": "vllm", "model": str(model), "python": a.python,
                   "served_model_name": "bench", "socket": str(sock),
                   "args": engine_args(model, a, sleep_mode=False), "env": env,
                   "stop_timeout_s": 30},
        "paths": {"state_dir": str(work / "state"), "snapshot_dir": str(snap_dir)},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_s": 1.0, "timeout_s": 10.0, "failures_before_restart": 3,
                   "start_timeout_s": BOOT_S},
        # Every kill is the bench's own: --runs of them within a minute or two would be a
        # crash loop to the default limit (5 in 300 s).
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "crash_loop_limit": 1000},
        "snapshots": {"enabled": "full" in paths, "regenerate": "after-serving",
                      "drift_check_interval_s": 0, "quiet_timeout_s": 60, "keep": 1},
    }
    result["engine_args"] = cfg["engine"]["args"]
    result["engine_env"] = cfg["engine"]["env"]
    uring = IO_URING.read_text().strip()
    IO_URING.write_text("2")  # CRIU refuses io_uring, which vLLM's API server sets up
    result["cold"] = []
    try:
        if "hybrid" in paths or "warm" in paths:
            # First: the path this bench exists for, kept should a later phase run out of
            # time.
            holder_phase(result, cfg, a, model, work, save)
        if not {"cold", "full", "sleep"} & set(paths):
            return
        agent = Agent(cfg, work)
        try:
            cache = compile_cache_entries()
            st = agent.wait(started, BOOT_S, "first start")
            result["cold"].append({**st["last_recovery"], "compile_cache_entries": cache,
                                   "sleep_mode": False})
            log(f"cold start (agent A) {st['last_recovery']}")
            save()
            if "full" in paths:
                snap = first_snapshot(agent)
                snap["image_on_disk_bytes"] = image_on_disk(snap_dir, snap["id"])
                result["snapshot"] = snap
                save()
                result["full"] = []
                for n in range(1, a.runs + 1):
                    rec = recover(agent, n, a.steady_requests)
                    result["full"].append(rec)
                    if rec["path"] != "full":
                        # The restore failed (fallthroughs say why) and the image is
                        # quarantined: what follows would be cold starts, measured below.
                        log(f"recovery {n} fell through to {rec['path']}: {rec['fallthroughs']}")
                        result["cold"].append({**rec, "after_failed_restore": True,
                                               "compile_cache_entries": None,
                                               "sleep_mode": False})
                        save()
                        break
                    save()
        finally:
            agent.stop()
        if "cold" in paths or "sleep" in paths:
            b = work / "cold"
            b.mkdir()
            sleep_mode = "sleep" in paths and a.device != "cpu"
            bcfg = {**cfg, "paths": {"state_dir": str(b / "state")},
                    "engine": {**cfg["engine"], "socket": str(b / "engine.sock"),
                               "args": engine_args(model, a, sleep_mode)},
                    "snapshots": {**cfg["snapshots"], "enabled": False}}
            result["engine_args_b"] = bcfg["engine"]["args"]
            agent = Agent(bcfg, b)
            try:
                for n in range(a.runs - 1):
                    cache = compile_cache_entries()
                    if n == 0:
                        st = agent.wait(started, BOOT_S, "agent B's first start")
                        rec = st["last_recovery"]
                    else:
                        rec = recover(agent, n, 0)
                    result["cold"].append({**rec, "compile_cache_entries": cache,
                                           "sleep_mode": sleep_mode})
                    log(f"cold start {len(result['cold'])}: {rec['duration_s']:.2f} s "
                        f"{rec['stages']}")
                    save()
                    if n == 0 and "sleep" in paths:
                        result["sleep"] = sleep_wake(b / "engine.sock", "bench", a.runs)
                        save()
            finally:
                agent.stop()
                with contextlib.suppress(OSError):
                    shutil.copy(b / "agent.log", a.out / f"agent-cold-{tag}.log")
    finally:
        IO_URING.write_text(uring)
        with contextlib.suppress(OSError):
            shutil.copy(work / "agent.log", a.out / f"agent-{tag}.log")
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save()
        log("wrote", out_json)
        for r in result["rows"]:
            log(f"{r['path']}: median {r['median_s']} s of {r['runs_s']}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
