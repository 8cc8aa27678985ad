"""What keeping engines from outliving the agent costs, and how fast a SIGKILLed agent is
replaced. Not run by `make test`.

    .venv/bin/python bench/orphan_bench.py [--runs 3] [--spawns 20] [--out DIR]

Rows (JSON into --out, default bench/results/, <date>-orphan-<host>.json):
- spawn / spawn+deathsig: Popen to exit of `true`, straight and through the exec wrapper
  that arms PR_SET_PDEATHSIG: the wrapper's cost on every engine start.
- agent-sigkill-engine-gone: SIGKILL of an agent (reference engine, tiny model) until its
  engine no longer runs.
- agent-sigkill-restart-full: SIGKILL of an agent that holds a snapshot until a new agent
  on the same state directory is ready through a full restore (it first waits for the old
  engine's PID to be reaped, which the restore needs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import proc  # noqa: E402
from tests.agentproc import RunningAgent, agent_config  # noqa: E402
from tests.conftest import cached_model  # noqa: E402


def timed_spawn(argv: list[str]) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True)
    return time.monotonic() - t0


def gone(pid: int, start_time: int, timeout: float = 30) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = proc.stat(pid)
        if st is None or st.state == "Z" or st.start_time != start_time:
            return time.monotonic()
        time.sleep(0.001)
    raise RuntimeError(f"engine {pid} still runs {timeout} s after its agent died")


def sigkill_rows(runs: int, model: Path) -> tuple[list[float], list[float]]:
    engine_gone, restart = [], []
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="orphan-bench-") as tmp:
            cfg = agent_config(Path(tmp), model)
            a = RunningAgent(Path(tmp), cfg)
            try:
                a.wait_ready()
                st = a.wait_for(lambda s: "published" in s.get("reason", ""), 120, "a snapshot")
                pid = st["engine_pid"]
                started = proc.stat(pid).start_time
                t0 = time.monotonic()
                a.proc.send_signal(signal.SIGKILL)
                engine_gone.append(gone(pid, started) - t0)
                a.proc.wait()
                b = RunningAgent(Path(tmp), cfg)
                try:
                    st = b.wait_ready()
                    restart.append(time.monotonic() - t0)
                    path = st["last_recovery"]["path"]
                    if path != "full":
                        raise RuntimeError(f"run {i}: the new agent came up via {path}")
                finally:
                    b.stop()
            finally:
                a.stop()
        print(f"run {i}: engine gone {engine_gone[-1] * 1000:.1f} ms, new agent ready "
              f"{restart[-1]:.2f} s", file=sys.stderr)
    return engine_gone, restart


def row(engine: str, path: str, runs: list[float], machine: str, command: str) -> dict:
    return {"engine": engine, "path": path, "gib": 0.0, "runs_s": [round(r, 4) for r in runs],
            "median_s": round(statistics.median(runs), 4), "machine": machine,
            "command": command}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spawns", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    machine = f"{platform.node()} ({os.cpu_count()} cpus, kernel {platform.release()})"
    true = ["true"]
    plain = [timed_spawn(true) for _ in range(args.spawns)]
    wrapped = [timed_spawn(proc.with_deathsig(true)) for _ in range(args.spawns)]
    model = cached_model("tiny")
    engine_gone, restart = sigkill_rows(args.runs, model)
    rows = [row("none", "spawn", plain, machine, command),
            row("none", "spawn+deathsig", wrapped, machine, command),
            row("reference", "agent-sigkill-engine-gone", engine_gone, machine, command),
            row("reference", "agent-sigkill-restart-full", restart, machine, command)]
    args.out.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    out = args.out / f"{day}-orphan-{platform.node()}.json"
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['path']:28} median {r['median_s'] * 1000:9.1f} ms  ({len(r['runs_s'])} runs)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
