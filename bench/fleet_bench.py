"""A node that never ran the model: pull the fleet's snapshot and restore it, against a cold start.

Runs the real agent with the reference engine (or, with `--engine vllm`, vLLM with the Pitstop
plugin) over a model of --gib GiB made by `pitstop make-model`, in one run:

1. cold: `--runs` cold starts (snapshots off), the baseline;
2. seed: an agent with a holder makes the first snapshot (hybrid) and pushes it
   (`snapshots.publish`) to the S3 store; then one without a holder does the same (full);
3. pull+refill: `--runs` times, the node's state (its snapshot store) and holder wiped, a
   fresh empty holder, and a start that pulls the hybrid image, has the holder load the
   weights from the model files (the refill rung) and restores the image;
4. pull+full: `--runs` times, the store wiped, no holder: a start that pulls the full image
   and restores it.

Each start is timed by the agent itself (`last_recovery.duration_s`: from the decision to
start, pull included, to the verified canary), and the pull's bytes and seconds give the
download rate (`last_pull`). The store is `--url` (credentials and endpoint from the AWS_*
variables and ~/.aws, as the agent reads them); without it the bench starts moto's
S3-compatible server on loopback (the dev extra), whose Python server, not a network,
then bounds the rate. On the GPU host, from the repository root:

    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/fleet_bench.py OUT --gib 8
    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/fleet_bench.py OUT --gib 8 \\
        --engine vllm --python /opt/vllm/bin/python --site /tmp/vsite

and on CPU (`--device cpu`) it is a dry run of the same script. Writes
OUT/fleet-<engine>-<gib>gib.json with `rows` (engine, path, gib, runs_s, median_s, machine,
command; for vLLM `vllm_version`), each with `node_ready_s`: from the agent's launch on the
new node to its engine serving a verified canary, as the node's operator sees it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpu_recovery_bench import (
    REPO,
    Agent,
    gpu_id,
    kv_args,
    log,
    machine,
    start_holder,
    starts,
    stop_holder,
)
from vllm_bench_kit import add_model_args, add_vllm_args, model_kind

IO_URING = Path("/proc/sys/kernel/io_uring_disabled")

BUCKET = "pitstop-fleet-bench"


@contextlib.contextmanager
def store(url: str | None, work: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(s3 URL, environment for the agents): `url` as given, or moto's server on loopback."""
    if url:
        yield url, {}
        return
    sys.path.insert(0, str(REPO))
    from tests.s3_server import s3_server

    with s3_server(work / "aws") as server:
        server.create_bucket(BUCKET)
        yield f"s3://{BUCKET}/bench", server.env()


def node(cfg: dict, work: Path, name: str) -> dict:
    """`cfg` as a node of its own: a state directory (and so a snapshot store) of its own,
    emptied first; the engine's socket and the holder's directory stay the fleet's."""
    state = work / name
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    return {**cfg, "paths": {"state_dir": str(state / "state")}}


def seed(cfg: dict, work: Path, name: str) -> dict:
    """The first node: a cold start, its snapshot, pushed. What the push moved and took."""
    agent = Agent(node({**cfg, "snapshots": {**cfg["snapshots"], "publish": True}}, work,
                       name), work / name)
    try:
        st = agent.wait(lambda s: (s.get("last_push") or {}).get("result") not in (None, ""),
                        1800, f"{name}'s snapshot pushed")
    finally:
        agent.stop()
    push = st["last_push"]
    if push["result"] != "ok":
        raise SystemExit(f"{name}: the push failed: {push}")
    log(f"{name}: pushed {push['snapshot']} ({push['kind']}): {push['bytes'] / 1e9:.2f} GB "
        f"in {push['seconds']:.1f}s")
    return {**push, "first_start": st["last_recovery"]}


def pulled_start(cfg: dict, work: Path, name: str, want: str) -> dict:
    """A node that never ran the engine: its start, which pulls and restores."""
    t0 = time.monotonic()
    agent = Agent(node(cfg, work, name), work / name)
    try:
        st = agent.wait(lambda s: s.get("state") == "ready", 1800, f"{name} ready")
        ready_s = round(time.monotonic() - t0, 3)
    finally:
        agent.stop()
    rec, pull = st["last_recovery"], st.get("last_pull") or {}
    log(f"{name}: {rec['path']} in {rec['duration_s']:.2f}s; pull {pull.get('result')} "
        f"{pull.get('bytes', 0) / 1e9:.2f} GB in {pull.get('seconds', 0):.2f}s")
    if rec["path"] != want or pull.get("result") != "ok":
        log(f"{name}: expected a pull and {want}: {rec.get('fallthroughs')} {pull}")
    return {**rec, "pull": pull, "node_ready_s": ready_s}


def rows(result: dict, gib: float, command: str, engine: str) -> list[dict]:
    where, host = machine()
    out = []
    for path, want in (("cold", "cold"), ("pull+refill", "refill"), ("pull+full", "full")):
        recs = [r for r in result.get(path, []) if r.get("result") == "success"
                and r.get("path") == want]
        if not result.get(path):
            continue
        runs = [r["duration_s"] for r in recs]
        pulls = [r["pull"] for r in recs if r.get("pull")]
        rates = [p["bytes"] / p["seconds"] / 1e6 for p in pulls if p.get("seconds")]
        out.append({
            "engine": engine, "path": path, "gib": gib, "runs_s": runs,
            # None: every start fell to another path (`fell_to` says which).
            "median_s": statistics.median(runs) if runs else None, "machine": where, "host": host,
            "command": command,
            "fell_to": [r["path"] for r in result.get(path, []) if r.get("path") != want],
            **({"node_ready_s": [r["node_ready_s"] for r in recs if "node_ready_s" in r]}
               if path != "cold" else {}),
            **({"vllm_version": result.get("vllm_version"), **result["model_kind"]}
               if engine == "vllm" else {}),
            **({"pull_s": [p["seconds"] for p in pulls],
                "pulled_bytes": [p["bytes"] for p in pulls],
                "download_mb_per_s": [round(r, 1) for r in rates],
                "download_median_mb_per_s": round(statistics.median(rates), 1) if rates
                else None,
                "stages_median_s": {k: round(statistics.median(r["stages"].get(k, 0.0)
                                                               for r in recs), 4)
                                    for k in sorted({k for r in recs for k in r["stages"]})}}
               if pulls else {}),
        })
    # Each seed's first start is a cold start of the same model in the same run (the hybrid
    # seed's also loads the weights into the holder): the figure a pulling node is set against.
    for seed in ("seed_hybrid", "seed_full"):
        first = (result.get(seed) or {}).get("first_start") or {}
        if first.get("result") == "success":
            out.append({
                "engine": engine, "path": f"{seed.replace('_', '-')}-first-start", "gib": gib,
                "runs_s": [first["duration_s"]], "median_s": first["duration_s"],
                "machine": where, "host": host, "command": command, "started_as": first["path"],
                **({"vllm_version": result.get("vllm_version"), **result["model_kind"]}
                   if engine == "vllm" else {}),
            })
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/pitstop-models"))
    ap.add_argument("--work", type=Path, default=Path("/root/pitstop-fleet-bench"))
    ap.add_argument("--url", help="s3://BUCKET/PREFIX (default: moto's server on loopback)")
    ap.add_argument("--paths", default="cold,pull+refill,pull+full")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    add_vllm_args(ap)
    add_model_args(ap)
    return ap.parse_args()


def pull_runs(result: dict, cfg: dict, held: dict, work: Path, a: argparse.Namespace,
              save: Callable[[], None]) -> None:
    """Seed the store, then `--runs` nodes that pull and restore, for each path asked."""
    paths = a.paths.split(",")
    holder_dir = Path(held["holder"]["dir"])
    gpu = held["holder"]["gpu"]
    if "pull+refill" in paths:
        holder = start_holder(gpu, holder_dir, work)
        try:
            result["seed_hybrid"] = seed(held, work, "seed-hybrid")
        finally:
            stop_holder(holder)
        result["pull+refill"] = []
        for n in range(a.runs):
            # Wiped: the node's store (node() empties its state) and the holder's memory
            # and directory (no refill plan left there).
            shutil.rmtree(holder_dir, ignore_errors=True)
            holder = start_holder(gpu, holder_dir, work)
            try:
                result["pull+refill"].append(
                    pulled_start(held, work, f"node-refill-{n}", "refill"))
            finally:
                stop_holder(holder)
            save()
    if "pull+full" in paths:
        result["seed_full"] = seed(cfg, work, "seed-full")
        result["pull+full"] = [pulled_start(cfg, work, f"node-full-{n}", "full")
                               for n in range(a.runs)]
        save()


def engine_of(a: argparse.Namespace, work: Path, result: dict) -> dict:
    """The fleet's engine section: the reference engine, or vLLM with the Pitstop plugin."""
    if a.engine == "vllm":
        from vllm_bench_kit import plugin_engine_env
        from vllm_gpu_bench import engine_args, model_dir

        model = model_dir(a)
        env, features = plugin_engine_env(a, work)
        result["vllm"], result["vllm_version"] = features.describe(), features.version
        result["model_kind"] = model_kind(a)
        engine = {"kind": "vllm", "python": a.python, "served_model_name": "bench", "env": env,
                  "args": engine_args(model, a, False)}
    else:
        model = a.models / f"{a.gib:g}gib"
        subprocess.run([sys.executable, "-m", "agent", "make-model", str(model),
                        "--target-gib", str(a.gib)], cwd=REPO, check=True,
                       env={**os.environ, "PITSTOP_MODELGEN_DEVICE": a.device})
        engine = {"kind": "reference", "device": a.device,
                  "args": kv_args(model, a.kv_gib, a.max_len)}
    result["weights_bytes"] = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    # The fleet's one configuration: the same socket on every node.
    return {**engine, "model": str(model), "stop_timeout_s": 30,
            "socket": str(work / "engine.sock")}


def main() -> None:
    a = parse_args()
    paths = a.paths.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.gib:g}gib"
    name = f"fleet-{a.engine}-{tag}.json"
    command = " ".join(["python3", *sys.argv])
    result: dict = {"gib": a.gib, "runs": a.runs, "engine": a.engine,
                    "host": os.uname().nodename}
    work = a.work / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gpu = gpu_id(a.device)
    holder_dir = work / "holder"
    cfg = {
        "engine": engine_of(a, work, result),
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"start_timeout_s": 900, "timeout_s": 10},
        "snapshots": {"drift_check_interval_s": 0, "quiet_timeout_s": 60,
                      "regenerate": "before-serving", "pull_timeout_s": 1800},
        "restart": {"crash_loop_limit": 1000},
    }

    def save() -> None:
        result["rows"] = rows(result, a.gib, command, a.engine)
        (a.out / name).write_text(json.dumps(result, indent=1))

    uring = IO_URING.read_text().strip()
    if a.engine == "vllm":
        IO_URING.write_text("2")  # CRIU refuses io_uring, which vLLM's API server sets up
    try:
        if "cold" in paths:
            off = node({**cfg, "snapshots": {"enabled": False}}, work, "cold")
            result["cold"] = starts(off, work / "cold", a.runs, "cold start", 0)
            save()
        with store(a.url, work) as (url, env):
            os.environ.update(env)  # the agents started from here reach the store with these
            cfg["snapshots"]["remote"] = url
            result["store"] = url if a.url else f"{url} (moto's server on loopback)"
            held = {**cfg, "holder": {"enabled": True, "dir": str(holder_dir), "gpu": gpu}}
            pull_runs(result, cfg, held, work, a, save)
    finally:
        IO_URING.write_text(uring)
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save()
    log("wrote", a.out / name)


if __name__ == "__main__":
    main()
