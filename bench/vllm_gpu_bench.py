"""CUDA vLLM on a GPU, every recovery path side by side: Pitstop's rungs and vLLM's own.

On the GPU host, from the repository root, with a CUDA vLLM (0.33) importable from --site:

    python3 bench/vllm_gpu_bench.py OUT --gib 8 --site /tmp/vsite033 \\
        --engine-env VLLM_USE_FLASHINFER_SAMPLER=0 \\
        --engine-env PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 \\
        --criu .gpu/criu/bin/criu --cuda-checkpoint /tmp/cc/cuda-checkpoint \\
        --cuda-plugin-dir /tmp/cc --budget-s 500 --paths hybrid,refill,warm

One model of --gib GiB (`pitstop make-model --target-gib`, in /dev/shm), the real agent
(`pitstop run`, engine.kind vllm) in phases, each a fresh agent:

- **holder** (paths hybrid, refill, standby, warm): a holder (`pitstop holder`, cuda
  backend) and the Pitstop plugin for vLLM's interpreter. The first start loads the weights
  into the holder (its peak GPU memory is recorded: `first-start-holder`), a hybrid
  snapshot is taken, then --hybrid-runs (default --runs) SIGKILLs of the API server come
  back through `hybrid`; once the agent has written
  its copy of the held set (the refill plan), --runs times the holder is restarted empty
  and the API server killed: `refill`; with `standby`, an agent with `snapshots.standby`
  over the same holder and store restores that image, and --runs kills (each once `pitstop
  status` says a standby is armed) come back through `standby`; then the snapshots are
  deleted and --warm-runs kills come back through `warm` (a fresh vLLM attaching the held
  weights).
- **pitstop** (paths cold, full, sleep): no holder. The first start is a plain one (its peak
  GPU memory: `first-start-plain`); with `full` a snapshot is taken and --runs kills come
  back through `full`; the snapshots deleted, one more kill comes back through `cold`; then
  vLLM's own sleep (level 1) and wake_up, --runs times (`sleep-wake`, process alive).
- **vllm-snapshot**: `pitstop vllm-snapshot create` over a Hugging Face cache this script
  makes of the model (symlinks, a fixed 40-hex revision, HF_HUB_OFFLINE=1), then an agent
  with `snapshots.backend: vllm`: its first start and --runs kills come back through the
  `vllm-snapshot` rung; then, the agent stopped, `vllm snapshot restore` of the same
  snapshot run by hand as a user of vLLM would (`python3 -m vllm.entrypoints.cli.main`),
  --runs times after a SIGKILL of the restored API server (`vllm-snapshot-manual`).
- **vllm-preload**: vLLM's weight-cache daemon (`pitstop vllm-preload`, what its unit runs),
  then an agent with `vllm.preload.enabled`: its first start and --runs kills come back
  through the `vllm-preload` rung (`--load-format ipc_cache`).

Every recovery is timed twice: the agent's own figure (decision to restart -> verified
canary, `runs_s`) and the client's (`kill_to_answer_s`: SIGKILL of the API server -> the
next request through the front that completes; its answer must equal the one before), and
between them `kill_breakdown` (vllm_bench_kit.py) says where the client's seconds went.
A rung's first start (a fresh agent) is `first_start_s` beside its row, not one of its
`runs_s`; a row made of the first start alone (the warm rung with --warm-runs 0) says
`from_first_start`. Each hybrid-family row has the image's `image_memory` (`pitstop snapshot
memory`: bytes, mappings, runs and 2 MiB windows by process and kind). `--debug-restore` adds
one hybrid kill after the timed ones with CRIU's timestamped debug log (the row's
`debug_restore`, its log kept beside the results); `--restore-log-level N` runs every restore
at level N instead (rows say `restore_log_level`).
`--arch qwen3-moe` (a mixture of experts), `--quant fp8|fp8-ct|w8a8-int8|awq` (a checkpoint
pre-quantized so) and `--quantization fp8` (vLLM quantizes a bf16 checkpoint at load) choose
the model; each row says which in `architecture` and `quantization`, and the file's name too
(`vllm-gpu-8gib-qwen3-moe.json`, `vllm-gpu-8gib-llama-fp8-ct-checkpoint.json`).
OUT/vllm-gpu-<gib>gib.json is written after every phase, so a run cut short keeps what it
measured; phases of an earlier run into the same OUT are kept (run --paths subsets one after
the other, each under its own --budget-s, to fit a caller's time limit). A phase or a run
that would not fit --budget-s is skipped, with the reason in `skipped`.

`--tp N` runs vLLM with N tensor-parallel workers (one GPU each; on --device cpu, one core
each): the rows carry `tp` and the file's name ends in `-tpN`. On CUDA Pitstop's image rungs
and its warm start skip such an engine (`tensor_parallel`; docs/vllm.md, "Tensor parallel"),
so cold and vLLM's own rungs are what it measures there; on --device cpu hybrid, warm and
cold.

`--device cpu` is a dry run against vLLM's CPU build (.venv-vllm) on the tests' tiny Llama:
hybrid, refill, warm, full and cold; the rest need CUDA and are skipped with that reason.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from criu_restore_log import as_json as restore_log_json  # noqa: E402
from criu_restore_log import read_log as read_restore_log  # noqa: E402
from gpu_recovery_bench import (  # noqa: E402
    Agent,
    gpu_id,
    log,
    machine,
    manifest,
    restart_holder,
    snapshots,
    standby_costs,
    start_holder,
    stop_holder,
    stop_process,
)
from vllm_bench_kit import (  # noqa: E402
    Budget,
    add_model_args,
    add_vllm_args,
    answer,
    engine_call,
    engine_env,
    first_answer,
    gpu_used_bytes,
    hf_cache,
    install_plugin,
    kill_breakdown,
    kill_to_answer,
    kill_tree,
    make_model_argv,
    model_kind,
    model_tag,
    plugin_pythonpath,
    set_subreaper,
    stamp_records,
    start_peaks,
    summarize,
    tree_of,
    write_config,
)

from agent.config import SnapshotsConfig  # noqa: E402
from agent.engines.vllm.cli import VllmFeatures, read_features  # noqa: E402
from agent.errors import HolderError  # noqa: E402
from agent.holder.client import HolderClient  # noqa: E402
from agent.modelgen import make_model, record_for, spec_for  # noqa: E402

IO_URING = Path("/proc/sys/kernel/io_uring_disabled")
BOOT_S = 900
# CRIU's debug level (-v4): every line timestamped (--debug-restore).
DEBUG_LOG_LEVEL = 4
# Where an agent's state keeps CRIU's log of each restore and of each dump.
RESTORE_LOGS = "**/run/criu/*-restore-*.log"
DUMP_LOGS = "**/snapshots/.logs/*-dump.log"
MODEL_NAME = "bench"
# Where the held set's copy and the refill plan appear (agent/holder/weightplan.py).
PLAN_NAME = "refill.json"
PATHS = ("hybrid", "refill", "standby", "standby-woken", "warm", "cold", "full",
         "sleep", "vllm-snapshot", "vllm-snapshot-manual", "vllm-preload")
CUDA_ONLY = ("sleep", "vllm-snapshot", "vllm-snapshot-manual", "vllm-preload")
PHASES = {  # in the order they run: the holder's rungs first, the ones this bench is for
    "holder": ("hybrid", "refill", "standby", "standby-woken", "warm"),
    "pitstop": ("cold", "full", "sleep"),
    "vllm-snapshot": ("vllm-snapshot", "vllm-snapshot-manual"),
    "vllm-preload": ("vllm-preload",),
}
SNAPSHOT_PORT = 8011
PRELOAD_PORT = 8470


@dataclass
class Run:
    """One run of the bench: its arguments, what it measured so far, where it works."""

    a: argparse.Namespace
    result: dict
    out_json: Path
    budget: Budget
    model: Path
    work: Path
    cfg: dict
    features: VllmFeatures
    command: str

    @property
    def cuda(self) -> bool:
        return self.a.device != "cpu"

    def wants(self, path: str) -> bool:
        return path in self.a.paths

    def save(self) -> None:
        ctx = {"gib": self.result["gib"], "command": self.command, "model": self.result["model"],
               "vllm_version": self.result.get("vllm_version"),
               "held_bytes": self.result.get("held_bytes"), "tp": self.a.tp,
               **({"eager": True} if self.a.eager else {}), "small_root": not self.a.engine_root,
               **restore_log(self.a),
               **model_kind(self.a)}
        r = self.result
        stamp_records(r, self.command)
        rows = [*start_peaks(r, ctx)]
        for path in ("hybrid", "refill", "standby", "standby-woken", "warm",
                     "full", "cold", "vllm-snapshot", "vllm-preload"):
            rows.append(rung_row(path, r, ctx))
        rows.append(summarize("vllm-snapshot-manual", r.get("vllm_snapshot_manual", []), ctx,
                              time_key="restore_to_answer_s"))
        rows.append(summarize("sleep-wake", r.get("sleep", []), ctx,
                              time_key="wake_to_answer_s"))
        for row in rows:
            snap = r.get({"full": "snapshot", "hybrid": "hybrid_snapshot",
                          "refill": "hybrid_snapshot",
                          "standby": "hybrid_snapshot",
                          "standby-woken": "hybrid_snapshot"}.get(
                              row["path"], "")) if row else None
            if row and snap:
                row["image_bytes"] = snap.get("image_bytes")
                row["image_memory"] = snap.get("memory")
            if row and row["path"] == "hybrid" and (
                    debug := debug_row(r.get("hybrid_debug", []), r.get("hybrid_debug_log"))):
                row["debug_restore"] = debug
            costs = r.get(f"{row['path'].replace('-', '_')}_costs") if row else None
            if row and row["path"].startswith("standby") and costs:
                row["standby_costs"] = costs
        r["rows"] = [x for x in rows if x]
        self.out_json.write_text(json.dumps(r, indent=1) + "\n")
        for name in ("holder", "pitstop", "vllm-snapshot", "vllm-preload"):
            for f in ("agent.log", "holder.log", "daemon.log", "manual.log"):
                with contextlib.suppress(OSError):
                    shutil.copy(self.work / name / f, self.a.out / f"{name}-{f}")
            # CRIU's own logs: with --restore-log-level 4, timestamped lines that say where a
            # restore's time goes; the dump's (always at 4) lists each mapping it dumped.
            for pattern, keep in ((RESTORE_LOGS, 3), (DUMP_LOGS, 1)):
                for kept in newest(self.work / name, pattern)[-keep:]:
                    with contextlib.suppress(OSError):
                        shutil.copy(kept, self.a.out / f"{name}-{kept.name}")


def rung_row(path: str, r: dict, ctx: dict) -> dict | None:
    """The row of `path` from its kills. A rung's first start (a fresh agent: no kill before
    it, so no client figure) is kept beside them as `first_start_s`, not among them; the row
    is made of it alone only where no kill was measured (the warm rung is a start)."""
    key, rung = path.replace("-", "_"), path.removesuffix("-woken")
    first = r.get(f"{key}_first")
    row = summarize(path, r.get(key, []), ctx, rung=rung)
    took = bool(first) and first.get("result", "success") == "success" \
        and first.get("path", rung) == rung and first.get("duration_s") is not None
    if row is None and took:
        row = summarize(path, [first], ctx, rung=rung)
        if row is not None:
            row["from_first_start"] = True
    if row is not None and took:
        row["first_start_s"] = first["duration_s"]
    return row


# --- the engine and its agent ----------------------------------------------------------------


def started(st: dict) -> bool:
    """The first start is over: the agent may already be snapshotting (within milliseconds
    of ready, too quick to poll)."""
    rec = st.get("last_recovery") or {}
    return rec.get("result") == "success" and st.get("state") in ("ready", "snapshotting")


def engine_args(model: Path, a: argparse.Namespace, sleep_mode: bool) -> list[str]:
    c = json.loads((model / "config.json").read_text())
    # vLLM refuses a --max-model-len above the model's max_position_embeddings.
    max_len = min(a.max_len, c["max_position_embeddings"])
    quant = ["--quantization", a.quantization] if a.quantization else []
    quant += ["--tensor-parallel-size", str(a.tp)] if a.tp > 1 else []
    quant += ["--enforce-eager"] if a.eager and a.device != "cpu" else []
    if a.device == "cpu":
        return ["--gpu-memory-utilization", "0.1", "--enforce-eager", "--max-model-len",
                str(min(max_len, 512)), *quant]
    # The KV pool by size, not as a fraction of the GPU: every image holds a pool of the
    # same size at every model size. vLLM still checks at start that this fraction of the
    # GPU is free; 0.6 leaves room for a CUDA context a killed engine has not given back.
    return ["--max-model-len", str(max_len), "--kv-cache-memory-bytes",
            str(int(a.kv_gib * (1 << 30))), "--gpu-memory-utilization", "0.6",
            "--max-num-seqs", "16", *(["--enable-sleep-mode"] if sleep_mode else []), *quant]


def agent_cfg(run_dir: Path, base: dict, **over: dict) -> dict:
    """The base configuration for an agent working in `run_dir`, sections replaced by
    `over` (merged one level down)."""
    cfg = {**base, "paths": {"state_dir": str(run_dir / "state")}}
    cfg["engine"] = {**base["engine"], "socket": str(run_dir / "engine.sock")}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def kill(agent: Agent, want: str) -> dict:
    """SIGKILL the agent's API server; the recovery as the agent saw it and as a client did."""
    st = agent.status()
    n = st.get("restarts", 0) + 1
    client = kill_to_answer(st["front"], MODEL_NAME, st["engine_pid"])
    st = agent.wait(lambda s: s.get("restarts", 0) >= n and s.get("state") in
                    ("ready", "snapshotting"), BOOT_S, f"recovery {n}")
    rec = {**st["last_recovery"], **client,
           "kill_breakdown": kill_breakdown(st["last_recovery"], client)}
    log(f"recovery {n}: {rec['path']} (wanted {want}) {rec['duration_s']:.2f} s by the agent, "
        f"{client['kill_to_answer_s']} s kill to answer, same answer {client['same_answer']}; "
        f"stages {rec['stages']}; fell through {rec.get('fallthroughs')}")
    return rec


def series(run: Run, agent: Agent, key: str, want: str, runs: int, each_s: float,
           before: Callable[[], object] | None = None) -> None:
    """`runs` kills that should come back through `want`, into result[key]; stops at the
    first that does not, or when the next would not fit the budget."""
    recs = run.result[key] = []
    for n in range(runs):
        why = run.budget.refuse(each_s, f"{want} run {n + 1}")
        if why:
            run.result.setdefault("skipped", {})[f"{want}#{n + 1}"] = why
            break
        if before is not None:
            before()
        rec = kill(agent, want)
        recs.append(rec)
        run.save()
        if rec["path"] != want:
            break


def take_snapshot(agent: Agent) -> dict:
    """Ask the running agent for a snapshot (`pitstop snapshot create`: regenerate is
    manual here, so no other is ever taken) and read what it holds from its manifest."""
    done = subprocess.run([sys.executable, "-m", "agent", "snapshot", "create", "--json",
                           "--config", str(agent.path)], cwd=REPO, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"snapshot create failed: {done.stderr[-1500:]}")
    sid = json.loads(done.stdout)["id"]
    m = manifest(agent.path, sid)
    snap = {"id": sid, "kind": m.get("kind"), "timings": m.get("timings"),
            "image_bytes": sum(f["size"] for f in m["files"]),
            "largest_files": {f["name"]: f["size"] for f in
                              sorted(m["files"], key=lambda f: -f["size"])[:6]},
            "memory": image_memory(agent, sid)}
    log(f"snapshot {snap}")
    return snap


def image_memory(agent: Agent, sid: str, top: int = 16) -> list[dict] | str:
    """What the image's pages come from (`pitstop snapshot memory`): the largest rows, by
    process and kind of mapping, for what a restore reads back (or why it could not say)."""
    done = subprocess.run([sys.executable, "-m", "agent", "snapshot", "memory", sid, "--json",
                           "--config", str(agent.path)], cwd=REPO, capture_output=True,
                          text=True)
    if done.returncode != 0:
        return done.stderr.strip()[-500:]
    return json.loads(done.stdout)[:top]


def delete_snapshots(agent: Agent) -> None:
    ids = [s["id"] for s in snapshots(agent.path)]
    if ids:
        subprocess.run([sys.executable, "-m", "agent", "snapshot", "delete", *ids, "--config",
                        str(agent.path)], cwd=REPO, check=True, capture_output=True)


def first_start(agent: Agent, what: str, baseline: int | None) -> dict:
    st = agent.wait(started, BOOT_S, what)
    rec = {**st["last_recovery"], "gpu_baseline_bytes": baseline, "what": what}
    log(f"{what}: {rec['path']} in {rec['duration_s']:.2f} s, peak GPU memory "
        f"{rec.get('gpu_peak_bytes')} (baseline {baseline})")
    return rec


def held_bytes(hdir: Path, gpu: str) -> int | None:
    """What the holder holds once the engine is ready: the tensors vLLM serves from, so an
    FP8 model holds about half of its bf16 checkpoint's bytes (--gib is the bf16 size)."""
    try:
        with HolderClient.for_gpu(hdir, gpu, timeout=5.0) as h:
            return h.stats().bytes_committed
    except (HolderError, OSError) as e:
        log(f"held bytes not read: {e}")
        return None


def start_estimate(run: Run) -> float:
    """Seconds one engine start takes: the first start this run measured, else a guess."""
    for key in ("first_start_plain", "first_start_holder"):
        rec = run.result.get(key)
        if rec and rec.get("duration_s"):
            return float(rec["duration_s"])
    return 60.0 + 4.0 * run.result["gib"] if run.cuda else 90.0


# --- the phases ------------------------------------------------------------------------------


def wait_refill_plan(plan: Path, limit_s: float) -> tuple[float, str] | None:
    """Seconds until the agent's refill plan of the held set is there, and what it loads
    from: a recipe of the model files (a dense model: vLLM's parameters are the files'
    tensors, cut or fused) or a copy of the held set (written once: what no recipe
    rebuilds)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        with contextlib.suppress(OSError, ValueError):
            source = json.loads(plan.read_text()).get("source")
            if source in ("recipe", "copy"):
                return round(time.monotonic() - t0, 2), source
        time.sleep(0.5)
    return None


def holder_phase(run: Run) -> None:
    a, r = run.a, run.result
    d = run.work / "holder"
    d.mkdir(parents=True, exist_ok=True)
    plugin = install_plugin(a, d)
    gpu = gpu_id(a.device)
    hdir = d / "holder-dir"
    env = dict(run.cfg["engine"]["env"])
    env["PYTHONPATH"] = plugin_pythonpath(a, plugin)
    snaps = any(run.wants(p) for p in ("hybrid", "refill", "standby", "standby-woken"))
    cfg = agent_cfg(d, run.cfg, engine={"env": env},
                    holder={"enabled": True, "dir": str(hdir), "gpu": gpu},
                    snapshots={"enabled": snaps})
    holder = [start_holder(gpu, hdir, d)]
    try:
        baseline = gpu_used_bytes()
        agent = Agent(cfg, d)
        try:
            r["first_start_holder"] = first_start(agent, "first start over the holder",
                                                  baseline)
            r["held_bytes"] = held_bytes(hdir, gpu)
            run.save()
            if snaps:
                hybrid_and_refill(run, agent, holder, gpu, hdir, d)
        finally:
            agent.stop()
        for path in ("standby", "standby-woken"):
            if run.wants(path) and r.get("hybrid_snapshot", {}).get("kind") == "hybrid":
                standby_series(run, cfg, d, path)
        if run.wants("warm"):
            # A fresh agent with snapshots off: every start is a warm one (the holder holds
            # the weights), its first included.
            agent = Agent({**cfg, "snapshots": {**cfg["snapshots"], "enabled": False}}, d)
            try:
                r["warm_first"] = first_start(agent, "first start (warm)", None)
                series(run, agent, "warm", "warm", a.warm_runs, 30 + start_estimate(run))
            finally:
                agent.stop()
    finally:
        stop_holder(holder[0])
        # The copy is as large as the weights: the full image needs the disk next.
        shutil.rmtree(hdir / gpu / "copies", ignore_errors=True)


def standby_series(run: Run, cfg: dict, d: Path, path: str) -> None:
    """An agent with snapshots.standby over the same holder and store: its first start
    restores the hybrid image, a standby of it is armed, and each kill (once `pitstop
    status` says one is armed again) is answered by continuing it; `standby-woken`: with
    snapshots.standby_woken (the copy woken, its CUDA state on the GPU, before the crash)."""
    key = path.replace("-", "_")
    agent = Agent({**cfg, "snapshots": {**cfg["snapshots"], "standby": True,
                                        "standby_woken": path == "standby-woken"}}, d)
    costs = run.result[f"{key}_costs"] = []

    def armed() -> None:
        # What the armed standby costs while it waits (host PSS, idle CPU, GPU memory),
        # and how long after the last recovery it was armed again (None before kill 1).
        agent.wait_standby_armed(BOOT_S, "the standby armed")
        last = run.result.get(key) or []
        rearm = round(time.time() - last[-1]["at"], 3) if last else None
        costs.append({**standby_costs(agent), "rearmed_after_s": rearm})
        log(f"standby costs {costs[-1]}")

    try:
        run.result[f"{key}_start"] = first_start(agent, f"first start ({path})", None)
        series(run, agent, key, "standby", run.a.runs, 30 + start_estimate(run), armed)
    finally:
        agent.stop()


def hybrid_and_refill(run: Run, agent: Agent, holder: list[subprocess.Popen], gpu: str,
                      hdir: Path, d: Path) -> None:
    r = run.result
    r["hybrid_snapshot"] = snap = take_snapshot(agent)
    run.save()
    if snap.get("kind") != "hybrid":
        r.setdefault("skipped", {})["hybrid"] = f"the snapshot is {snap.get('kind')}"
        return
    if run.wants("hybrid"):
        series(run, agent, "hybrid", "hybrid", run.a.hybrid_runs, 30 + start_estimate(run))
        if run.a.debug_restore:
            debug_restore(run, agent)
    if not run.wants("refill"):
        return
    # The agent writes the refill plan of the held set (vLLM's parameters are not the
    # files' layout: a recipe of the files' tensors, else a copy) once the engine is ready.
    waited = wait_refill_plan(hdir / gpu / PLAN_NAME, limit_s=max(120.0, r["gib"] * 20))
    if waited is None:
        r.setdefault("skipped", {})["refill"] = "no refill plan of the held set was written"
        return
    r["refill_plan_wait_s"], r["refill_plan_source"] = waited

    def empty() -> None:
        # The holder restarted empty (as after its crash or a reboot), then the API server
        # is killed: the refill rung loads the plan, then restores.
        holder[0] = restart_holder(holder[0], gpu, hdir, d)

    series(run, agent, "refill", "refill", run.a.runs, 60 + r["gib"] * 5, empty)


def newest(where: Path, pattern: str) -> list[Path]:
    """The files under `where` that `pattern` matches, oldest first."""
    return sorted(where.glob(pattern), key=lambda p: p.stat().st_mtime)


def debug_restore(run: Run, agent: Agent) -> None:
    """One more hybrid kill, with CRIU's timestamped debug log of its restore (where the
    restore's time goes: bench/criu_restore_log.py sums it up into the row); the level goes
    back to what it was, for the paths after it."""
    was = agent.cfg.get("snapshots", {}).get(
        "restore_log_level", SnapshotsConfig.model_fields["restore_log_level"].default)
    agent.reload(restore_log_level=DEBUG_LOG_LEVEL)
    try:
        series(run, agent, "hybrid_debug", "hybrid", 1, 30 + start_estimate(run))
    finally:
        agent.reload(restore_log_level=was)
    logs = newest(run.work / "holder", RESTORE_LOGS)
    if run.result.get("hybrid_debug") and logs:
        try:
            run.result["hybrid_debug_log"] = restore_log_json(read_restore_log(logs[-1]))
        except (OSError, ValueError) as e:
            run.result["hybrid_debug_log"] = str(e)
        run.save()


def debug_row(recs: list[dict], criu_log: dict | str | None = None) -> dict | None:
    """The hybrid row's `debug_restore`: the kill under CRIU's debug log, by the agent, and
    what that log says of the restore (`criu_log`)."""
    if not recs:
        return None
    rec = recs[0]
    return {"restore_log_level": DEBUG_LOG_LEVEL, "path": rec.get("path"),
            "duration_s": rec.get("duration_s"), "stages": rec.get("stages"),
            "kill_to_answer_s": rec.get("kill_to_answer_s"), "criu_log": criu_log}


def pitstop_phase(run: Run) -> None:
    a, r = run.a, run.result
    d = run.work / "pitstop"
    d.mkdir(parents=True, exist_ok=True)
    # Sleep mode (vLLM's CuMemAllocator) on CUDA as over the holder, where the plugin turns
    # it on for the KV pool: the two first starts' peaks compare like with like.
    cfg = agent_cfg(d, run.cfg, engine={"args": engine_args(run.model, a, run.cuda)},
                    snapshots={"enabled": run.wants("full")})
    agent = Agent(cfg, d)
    try:
        r["first_start_plain"] = first_start(agent, "plain first start", gpu_used_bytes())
        run.save()
        if run.wants("full"):
            r["snapshot"] = take_snapshot(agent)
            run.save()
            series(run, agent, "full", "full", a.runs, 30 + 2 * r["gib"])
            delete_snapshots(agent)
        if run.wants("cold"):
            series(run, agent, "cold", "cold", a.cold_runs, 30 + start_estimate(run))
        if run.wants("sleep") and run.cuda:
            r["sleep"] = sleep_wake(agent.status()["front"], Path(cfg["engine"]["socket"]),
                                    a.runs)
            run.save()
    finally:
        agent.stop()
        shutil.rmtree(d / "state" / "snapshots", ignore_errors=True)


def sleep_wake(front: str, sock: Path, runs: int) -> list[dict]:
    """vLLM's own sleep (level 1: weights to host memory, KV pool dropped) and wake_up on
    the engine's private socket, each followed by the answer through the front."""
    before = answer(front, MODEL_NAME)
    out = []
    for n in range(1, runs + 1):
        t0 = time.monotonic()
        s1, b1 = engine_call(sock, "POST", "/sleep?level=1")
        t1 = time.monotonic()
        _, asleep = engine_call(sock, "GET", "/is_sleeping")
        t1b = time.monotonic()
        s2, b2 = engine_call(sock, "POST", "/wake_up")
        secs, text = first_answer(front, MODEL_NAME, t1b)
        rec = {"sleep_s": round(t1 - t0, 3), "wake_to_answer_s": secs,
               "status": [s1, s2], "asleep": _is_sleeping(asleep),
               "same_answer": text == before, "path": "sleep-wake"}
        if (s1, s2) != (200, 200):
            rec["error"] = (b1 if s1 != 200 else b2)[:300].decode(errors="replace")
            rec["result"] = "failure"
        log(f"sleep/wake {n}: {rec}")
        out.append(rec)
        if "error" in rec:
            break
    return out


def _is_sleeping(body: bytes) -> bool:
    try:
        return bool(json.loads(body).get("is_sleeping"))
    except (ValueError, AttributeError):
        return False


def vllm_snapshot_phase(run: Run) -> None:
    a, r = run.a, run.result
    d = run.work / "vllm-snapshot"
    d.mkdir(parents=True, exist_ok=True)
    repo = f"pitstop/bench-{model_tag(a)}"
    rev, hf_env = hf_cache(run.model, d / "hf", repo)
    cfg = agent_cfg(d, run.cfg, engine={"env": {**run.cfg["engine"]["env"], **hf_env}},
                    snapshots={"enabled": True, "backend": "vllm"},
                    vllm={"snapshot": {"model": repo, "revision": rev, "port": SNAPSHOT_PORT,
                                       "cuda_plugin_dir": str(a.cuda_plugin_dir),
                                       "timeout_s": 600}})
    cfg_path = write_config(cfg, d / "pitstop.yaml")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "agent", "vllm-snapshot", "create", "--json",
                           "--config", str(cfg_path)], cwd=REPO, capture_output=True,
                          text=True)
    r["vllm_snapshot_create"] = {"seconds": round(time.monotonic() - t0, 2),
                                 "returncode": done.returncode,
                                 "stderr_tail": done.stderr[-3000:]}
    run.save()
    if done.returncode != 0:
        log(f"vllm snapshot create failed: {done.stderr[-1500:]}")
        return
    sid = next(s["id"] for s in snapshots(cfg_path) if "-vllm-" in s["id"])
    r["vllm_snapshot_create"]["id"] = sid
    if run.wants("vllm-snapshot"):
        agent = Agent(cfg, d)
        try:
            r["vllm_snapshot_first"] = first_start(agent, "first start (vllm-snapshot)", None)
            run.save()
            series(run, agent, "vllm_snapshot", "vllm-snapshot", a.runs, 60 + 3 * r["gib"])
        finally:
            agent.stop()
    if run.wants("vllm-snapshot-manual"):
        # The agent's engine was this snapshot's tree: its PIDs must be free again.
        pids = manifest(cfg_path, sid).get("process", {}).get("pids", [])
        end = time.monotonic() + 60
        while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.05)
        manual_restores(run, cfg, Path(cfg["paths"]["state_dir"]) / "snapshots" / sid / "vllm",
                        d)


def manual_restores(run: Run, cfg: dict, artifact: Path, d: Path) -> None:
    """`vllm snapshot restore` as a user of vLLM runs it by hand once the engine died: the
    first from a stopped engine, each next one after a SIGKILL of the restored API server
    (its whole tree gone first: a restore wants the snapshot's PIDs free)."""
    from agent.config import parse_config
    from agent.engines.vllm.snapshot import VllmSnapshotBackend

    a = run.a
    backend = VllmSnapshotBackend.from_config(parse_config(cfg, "<bench>"), python=a.python,
                                              criu=a.criu)
    env = backend.env()  # the environment the snapshot was taken with (vLLM hashes it)
    argv = [a.python, "-m", "vllm.entrypoints.cli.main", "snapshot", "restore", str(artifact),
            "--host", "127.0.0.1", "--port", str(SNAPSHOT_PORT)]
    recs = run.result["vllm_snapshot_manual"] = []
    tree: list[int] = []
    # The restored tree leaves the restore command: it comes to this process to be reaped.
    set_subreaper(True)
    try:
        for n in range(a.runs + 1):
            why = run.budget.refuse(60 + 3 * run.result["gib"], f"manual restore {n + 1}")
            if why:
                run.result.setdefault("skipped", {})[f"vllm-snapshot-manual#{n + 1}"] = why
                break
            rec = manual_restore(argv, env, tree, d)
            recs.append(rec)
            run.save()
            if rec["result"] != "success":
                break
            with contextlib.suppress(OSError, ValueError, IndexError):
                tree = tree_of(int((artifact / "restored.pid").read_text().split()[0]))
    finally:
        kill_tree(tree)
        set_subreaper(False)


def manual_restore(argv: list[str], env: dict[str, str], tree: list[int], d: Path) -> dict:
    t_kill = None
    if tree:
        t_kill = time.monotonic()
        kill_tree(tree)
    t0 = time.monotonic()
    with (d / "manual.log").open("ab") as logf:
        done = subprocess.run(argv, env=env, stdout=logf, stderr=subprocess.STDOUT)
    restored = time.monotonic()
    secs, text = first_answer(f"127.0.0.1:{SNAPSHOT_PORT}", MODEL_NAME, t0, limit_s=120)
    rec = {"path": "vllm-snapshot-manual", "returncode": done.returncode,
           "restore_cli_s": round(restored - t0, 3), "restore_to_answer_s": secs,
           "kill_to_answer_s": round(secs + t0 - t_kill, 3) if t_kill and secs else None,
           "answer": text, "result": "success" if secs is not None else "failure"}
    log(f"manual vllm snapshot restore: {rec}")
    return rec


def vllm_preload_phase(run: Run) -> None:
    from agent.engines.vllm.preload import check_health

    a, r = run.a, run.result
    d = run.work / "vllm-preload"
    d.mkdir(parents=True, exist_ok=True)
    cfg = agent_cfg(d, run.cfg, snapshots={"enabled": False},
                    vllm={"preload": {"enabled": True, "socket_dir": str(d / "sock"),
                                      "health_port": PRELOAD_PORT}})
    cfg_path = write_config(cfg, d / "pitstop.yaml")
    t0 = time.monotonic()
    daemon = subprocess.Popen([sys.executable, "-m", "agent", "vllm-preload", "--config",
                               str(cfg_path), "--gpu", "0"], cwd=REPO,
                              stdout=(d / "daemon.log").open("ab"), stderr=subprocess.STDOUT)
    try:
        while check_health(PRELOAD_PORT) is not None:
            if daemon.poll() is not None or time.monotonic() - t0 > BOOT_S:
                r.setdefault("skipped", {})["vllm-preload"] = "the preload daemon did not start"
                return
            time.sleep(0.5)
        r["vllm_preload_daemon_s"] = round(time.monotonic() - t0, 2)
        run.save()
        agent = Agent(cfg, d)
        try:
            r["vllm_preload_first"] = first_start(agent, "first start (vllm-preload)", None)
            run.save()
            series(run, agent, "vllm_preload", "vllm-preload", a.runs, 30 + start_estimate(run))
        finally:
            agent.stop()
    finally:
        stop_process(daemon, 60)


# --- the run ---------------------------------------------------------------------------------


def phase_estimate(run: Run, phase: str) -> float:
    """Seconds a phase takes at least (its first start and one recovery), for --budget-s."""
    start, gib = start_estimate(run), run.result["gib"]
    return {"holder": 1.5 * start + 30, "pitstop": start + (30 + 2 * gib if run.wants("full")
                                                             else 0),
            "vllm-snapshot": 2.5 * start + 3 * gib, "vllm-preload": 2.5 * start}[phase]


def model_dir(a: argparse.Namespace) -> Path:
    if a.device == "cpu":
        spec = spec_for("tiny", seed=0, arch=a.arch, quant=a.quant)
        key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode())
        d = REPO / ".cache" / "models" / f"tiny-{key.hexdigest()[:16]}"
        make_model(d, spec)
        return d
    d = a.models / f"{a.gib:g}-{a.arch}-{a.quant}"
    # make-model leaves a complete model alone; a warm machine reuses the last call's.
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(d), *make_model_argv(a)],
                   cwd=REPO, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": a.device})
    return d


def restore_log(a: argparse.Namespace) -> dict[str, int]:
    """`restore_log_level` when --restore-log-level was given: a key of the agent's
    `snapshots` and of every row, which says the restores ran with that CRIU log."""
    return {} if a.restore_log_level is None else {"restore_log_level": a.restore_log_level}


def base_config(a: argparse.Namespace, model: Path, env: dict[str, str]) -> dict:
    return {
        "engine": {"kind": "vllm", "model": str(model), "python": a.python,
                   "served_model_name": MODEL_NAME, "args": engine_args(model, a, False),
                   "env": env, "stop_timeout_s": 30, "small_root": not a.engine_root},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_s": 1.0, "timeout_s": 10.0, "failures_before_restart": 3,
                   "start_timeout_s": BOOT_S},
        # Every kill is the bench's own: many within minutes would be a crash loop to the
        # default limit (5 in 300 s), and a backoff would add 0.2, 0.4, 0.8 s before the
        # decision of the second and later recoveries (kill_to_answer_s is one crash's).
        "restart": {"backoff_initial_s": 0, "backoff_max_s": 1.0, "crash_loop_limit": 1000},
        # Snapshots only when the bench asks (`pitstop snapshot create`): after a cold or
        # warm start the agent would otherwise take one by itself, and the next kill would
        # be restored instead of measuring that path again.
        "snapshots": {"enabled": False, "regenerate": "manual",
                      "drift_check_interval_s": 0, "quiet_timeout_s": 60, "keep": 1,
                      **({"criu": str(a.criu)} if a.criu else {}),
                      **restore_log(a)},
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"any of {', '.join(PATHS)}")
    ap.add_argument("--runs", type=int, default=2, help="kills per path")
    ap.add_argument("--hybrid-runs", type=int, default=None,
                    help="kills through hybrid (default: --runs): a few seconds each, so "
                         "more of them than of the slow paths fit one call")
    ap.add_argument("--warm-runs", type=int, default=1)
    ap.add_argument("--cold-runs", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip what would not fit in this many seconds")
    ap.add_argument("--kv-gib", type=float, default=2.0, help="the KV pool, in GiB")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--tp", type=int, default=1,
                    help="vLLM's tensor-parallel size (its workers, one GPU each); rows carry it")
    ap.add_argument("--eager", action="store_true",
                    help="vLLM's --enforce-eager (no torch.compile, no CUDA graphs): a warm "
                         "start then runs every kernel's Python again, with no compiled "
                         "graph from an earlier start to stand in for it; rows carry it")
    ap.add_argument("--engine-root", action="store_true",
                    help="vLLM's API server is the root of its process tree (engine.small_root "
                         "false), as before 2026-12-06; rows carry small_root")
    add_vllm_args(ap)
    add_model_args(ap)
    ap.add_argument("--criu", type=Path, default=os.environ.get("PITSTOP_CRIU"))
    ap.add_argument("--restore-log-level", type=int, choices=range(5), default=None,
                    help="the agent's snapshots.restore_log_level: 4 keeps CRIU's timestamped "
                         "debug log of each restore (it costs the restore some time); rows "
                         "carry restore_log_level")
    ap.add_argument("--debug-restore", action="store_true",
                    help="after the timed hybrid kills, one more with CRIU's timestamped debug "
                         "log (snapshots.restore_log_level 4, reloaded live, then back): the "
                         "hybrid row's `debug_restore`, kept apart from its runs (the log costs "
                         "the restore time); the log is kept beside the results")
    ap.add_argument("--cuda-checkpoint", type=Path, default=None,
                    help="NVIDIA's cuda-checkpoint binary (vLLM's snapshots run it)")
    ap.add_argument("--cuda-plugin-dir", type=Path, default=None,
                    help="the directory holding CRIU's cuda_plugin.so")
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/models"))
    ap.add_argument("--work", type=Path, default=Path("/root/pitstop-vllm-bench"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run on vLLM's CPU build")
    a = ap.parse_args()
    a.paths = a.paths.split(",")
    if a.hybrid_runs is None:
        a.hybrid_runs = a.runs
    unknown = sorted(set(a.paths) - set(PATHS))
    if unknown:
        ap.error(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    if a.criu:
        a.criu = a.criu.resolve()
    return a


def open_result(a: argparse.Namespace, out_json: Path, model: Path) -> dict:
    """What an earlier run into OUT measured on this model on this kind of machine (kept), or
    a new result: rows are labelled with the machine they are written on, so another GPU's
    runs must not be carried into them."""
    where = machine()[0]
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(out_json.read_text())
        if old.get("model_dir") == str(model) and \
                {r.get("machine") for r in old.get("rows", [])} <= {where}:
            return old
        log(f"{out_json}: another model's, or measured on another machine than {where}: "
            "starting a new result")
    return {"gib": a.gib, "model_dir": str(model), "runs": a.runs, "kv_gib": a.kv_gib}


def prepare(a: argparse.Namespace) -> Run:
    budget = Budget(a.budget_s)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.cuda_checkpoint:  # vLLM's snapshots run it by name
        os.environ["PATH"] = f"{a.cuda_checkpoint.resolve().parent}:{os.environ['PATH']}"
    tag = model_tag(a) if a.device != "cpu" else model_tag(a).replace(f"{a.gib:g}gib", "tiny")
    tag += f"-tp{a.tp}" if a.tp > 1 else ""
    tag += "-eager" if a.eager else ""
    t0 = time.monotonic()
    model = model_dir(a)
    out_json = a.out / f"vllm-gpu-{tag}.json"
    result = open_result(a, out_json, model)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    if a.device == "cpu":
        a.gib = round(weights / (1 << 30), 4)
    env = engine_env(a)
    if a.device == "cpu" and a.tp > 1:
        # vLLM's CPU build binds each worker's OpenMP threads to cores of its own.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(a.tp)))
    features = read_features(a.python, {**os.environ, **env})
    result.update(gib=a.gib, weights_bytes=weights, make_model_s=round(time.monotonic() - t0, 2),
                  model=model.name, vllm=features.describe(), vllm_version=features.version,
                  engine_env=env, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    log(f"model {model}: {weights / 1e9:.2f} GB; vLLM {features.describe()}")
    # Short: the holder's socket lies a GPU UUID further down, within a Unix socket's 107 bytes.
    work = a.work / hashlib.sha256(tag.encode()).hexdigest()[:8]
    for name in PHASES:  # this run's phases start clean; an earlier size's go for disk
        if any(p in a.paths for p in PHASES[name]):
            shutil.rmtree(work / name, ignore_errors=True)
    if a.work.exists():
        for old in a.work.iterdir():
            if old.name != work.name:
                shutil.rmtree(old, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3", "bench/vllm_gpu_bench.py", *sys.argv[1:]])
    return Run(a, result, out_json, budget, model, work, base_config(a, model, env), features,
               command)


RUNNERS = {"holder": holder_phase, "pitstop": pitstop_phase,
           "vllm-snapshot": vllm_snapshot_phase, "vllm-preload": vllm_preload_phase}


def main() -> None:
    a = parse_args()
    run = prepare(a)
    # What an earlier run into OUT skipped stays said, but for what this run tries again.
    mine = {*a.paths, *(ph for ph, ps in PHASES.items() if set(ps) & set(a.paths))}
    skipped = run.result["skipped"] = {k: v for k, v in run.result.get("skipped", {}).items()
                                       if k.split("#")[0] not in mine}
    if not run.cuda:
        for p in CUDA_ONLY:
            if p in a.paths:
                skipped[p] = "needs a CUDA build of vLLM and a GPU"
        a.paths = [p for p in a.paths if p not in CUDA_ONLY]
    uring = IO_URING.read_text().strip()
    IO_URING.write_text("2")  # CRIU refuses io_uring, which vLLM's API server sets up
    try:
        for phase, paths in PHASES.items():
            if not any(run.wants(p) for p in paths):
                continue
            why = run.budget.refuse(phase_estimate(run, phase), f"phase {phase}")
            if why:
                skipped[phase] = why
                continue
            log(f"phase {phase}: {', '.join(p for p in paths if run.wants(p))}")
            t0 = time.monotonic()
            RUNNERS[phase](run)
            run.result.setdefault("phase_s", {})[phase] = round(time.monotonic() - t0, 1)
            run.save()
    finally:
        IO_URING.write_text(uring)
        run.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        run.save()
        log("wrote", run.out_json)
        for row in run.result["rows"]:
            log(f"{row['path']}: median {row['median_s']} s of {row['runs_s']}; kill to answer "
                f"{row['kill_to_answer_s']}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
