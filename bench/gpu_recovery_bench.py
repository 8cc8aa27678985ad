"""Recovery paths of the real agent on a GPU: cold start vs restore, stage by stage.

Runs `pitstop run` with the reference engine on CUDA over a model of --gib GiB made
with `pitstop make-model`, kills the engine again and again, and reads what each
recovery took from the agent's own status (`status.json`: path, duration, stages).
Not part of `make test` (no GPU on CI). On the GPU host, from the repository root:

    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/gpu_recovery_bench.py OUT --gib 8

`--paths` picks the recoveries (all five by default, side by side in one run): full and
cold (no holder), hybrid, refill and warm (the agent with `holder.enabled`, over a
`pitstop holder` this script starts for GPU 0: the first start fills the holder, a hybrid
snapshot is taken, the engine is killed `--runs` times (hybrid); then `--runs` times the
holder is restarted empty and the engine killed (refill: the holder loads the weights from
the files, then the hybrid restore runs); then the agent is restarted with snapshots off
and every start attaches the held weights (warm)). A full restore needs room for an image
as large as the weights: when the snapshot directory's file system has less free space,
the full path is skipped and the result says why.

The run also measures the host's pinned host-to-device copy rate (torch, `--h2d-gib` of
pinned memory to the GPU, best of 5): the refill row gives its weight load in GB/s against it.

`--paths standby` (not in the default five) adds, after the hybrid kills, an agent with
`snapshots.standby` over the same holder and store: before each of --runs kills it waits
for `pitstop status` to say a standby is armed, and each recovery continues it;
`--paths standby-woken` the same with `snapshots.standby_woken` (the copy woken, its CUDA
state on the GPU and locked, before the crash).

Each kill is timed twice: by the agent (`runs_s`: its decision to the verified canary)
and by a client (`kill_to_answer_s`: SIGKILL -> the next answer through the front, which
must equal the one before; `kill_breakdown_median_s` says where those seconds went).
After every recovery one streamed request goes through the agent's front, then
--steady-requests more: the front's own `pitstop_front_time_to_first_token_seconds`
(scraped from the agent's /metrics before and after) gives the first request's time to
first token after that recovery and the steady-state one; the agent's status gives the GPU
memory in use at its peak during the recovery. Writes OUT/recovery-<gib>gib.json, whose
`rows` hold one line per path: recovery times, peak GPU memory and both first-token
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
# The kill helpers import the agent (a standby's root); on a GPU host it is not installed.
sys.path.insert(0, str(REPO))


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


class Agent:
    def __init__(self, cfg: dict, workdir: Path) -> None:
        self.cfg = cfg
        self.path = workdir / "pitstop.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.status_path = Path(cfg["paths"]["state_dir"]) / "run" / "status.json"
        self.status_path.unlink(missing_ok=True)
        self.logf = open(workdir / "agent.log", "ab")  # noqa: SIM115
        self.p = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config",
                                   str(self.path)], cwd=REPO, stdout=self.logf,
                                  stderr=subprocess.STDOUT)

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, pred, timeout: float, what: str) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if st and pred(st):
                return st
            if st.get("state") == "failed":
                self.stop()
                raise SystemExit(f"agent failed waiting for {what}: {st.get('reason')}")
            if self.p.poll() is not None:
                raise SystemExit(f"agent exited waiting for {what}")
            time.sleep(0.05)
        raise SystemExit(f"timed out waiting for {what}: {self.status()}")

    def reload(self, **snapshots: object) -> None:
        """Set these snapshots.* keys and reload (SIGHUP); returns once the agent logged the
        reload (a key it refuses stays as it was: the log says so)."""
        self.cfg = {**self.cfg, "snapshots": {**self.cfg.get("snapshots", {}), **snapshots}}
        self.path.write_text(yaml.safe_dump(self.cfg))
        journal = Path(self.logf.name)
        said = journal.read_text(errors="replace").count("configuration reloaded from")
        self.p.send_signal(signal.SIGHUP)
        end = time.monotonic() + 60
        while journal.read_text(errors="replace").count("configuration reloaded from") <= said:
            if time.monotonic() > end:
                raise SystemExit(f"the agent did not log the reload of {snapshots}")
            time.sleep(0.05)

    def wait_standby_armed(self, timeout: float, what: str) -> dict:
        """Until `pitstop status` says a standby is armed (snapshots.standby)."""
        return self.wait(lambda s: (s.get("standby") or {}).get("armed"), timeout, what)

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(120)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def kv_args(model: Path, kv_gib: float, max_len: int) -> list[str]:
    c = json.loads((model / "config.json").read_text())
    max_len = min(max_len, c["max_position_embeddings"])
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2
    slots = max(1, int(kv_gib * 2**30) // (per_token * max_len))
    return ["--kv-slots", str(slots), "--max-model-len", str(max_len), "--dtype", "bfloat16"]


def snapshots(cfg_path: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "agent", "snapshot", "list", "--json",
                          "--config", str(cfg_path)], cwd=REPO, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def manifest(cfg_path: Path, sid: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "agent", "snapshot", "inspect", sid, "--json",
                          "--config", str(cfg_path)], cwd=REPO, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


TTFT = "pitstop_front_time_to_first_token_seconds"


def first_token_sums(metrics: str) -> dict[str, tuple[float, float]]:
    """phase -> (sum, count) of the front's time to first token, all paths together."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != TTFT:
            continue
        for smp in family.samples:
            phase = smp.labels.get("phase", "")
            if smp.name == TTFT + "_sum":
                out.setdefault(phase, [0.0, 0.0])[0] += smp.value
            elif smp.name == TTFT + "_count":
                out.setdefault(phase, [0.0, 0.0])[1] += smp.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def stream_once(front: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 8,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://{front}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def first_tokens(agent: Agent, steady: int) -> dict:
    """The first streamed request after the recovery that just finished, then steady ones:
    their time to first token as the front measured it."""
    st = agent.status()
    front, metrics = st.get("front"), st.get("metrics")
    if not front or not metrics:
        return {}
    with urllib.request.urlopen(f"http://{front}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    before = first_token_sums(metrics)
    for _ in range(1 + steady):
        stream_once(front, model)
    after = first_token_sums(metrics)

    def mean(phase: str) -> float | None:
        s0, c0 = before.get(phase, (0.0, 0.0))
        s1, c1 = after.get(phase, (0.0, 0.0))
        return round((s1 - s0) / (c1 - c0), 4) if c1 > c0 else None

    return {"first_token_after_recovery_s": mean("after_recovery"),
            "first_token_steady_s": mean("steady")}


def served_model(agent: Agent) -> str:
    with urllib.request.urlopen(f"http://{agent.status()['front']}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def recover(agent: Agent, n: int, steady: int | None) -> dict:
    """SIGKILL the engine; its recovery as the agent timed it, and as a client did (the kill
    to the next answer through the front, vllm_bench_kit.kill_to_answer); then, unless
    `steady` is None, the first-token figures (first_tokens)."""
    from vllm_bench_kit import kill_breakdown, kill_to_answer

    st = agent.status()
    client = kill_to_answer(st["front"], served_model(agent), st["engine_pid"])
    st = agent.wait(lambda s: s.get("restarts") == n and s.get("state") == "ready", 900,
                    f"recovery {n}")
    rec = {**st["last_recovery"], **client,
           "kill_breakdown": kill_breakdown(st["last_recovery"], client),
           **(first_tokens(agent, steady) if steady is not None else {})}
    log(f"recovery {n}: {rec['path']} in {rec['duration_s']:.2f}s {rec['stages']}; "
        f"{client['kill_to_answer_s']} s kill to answer, same answer {client['same_answer']}; "
        f"peak GPU memory {rec.get('gpu_peak_bytes')}; first token after it "
        f"{rec.get('first_token_after_recovery_s')} s, steady {rec.get('first_token_steady_s')} s")
    return rec


def standby_tree(agent_pid: int, engine_pid: int | None) -> list[int]:
    """Every process of the armed standby: the agent's `agent.checkpoint.nsinit` child that
    is not the serving engine's, and all under it."""
    from agent.checkpoint.xcomp import process_tree

    for pid in process_tree(agent_pid)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"agent.checkpoint.nsinit" in cmd and pid != engine_pid:
            return process_tree(pid)
    return []


def standby_costs(agent: Agent, idle_s: float = 5.0) -> dict:
    """What the armed standby costs while it waits: host memory (the sum of its processes'
    PSS), CPU seconds over `idle_s`, and GPU memory (nvidia-smi's compute processes that
    are its own; none while its CUDA state stays checkpointed)."""
    st = agent.status()
    pids = standby_tree(agent.p.pid, st.get("engine_pid"))
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        total = 0
        for pid in pids:
            try:
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(f[11]) + int(f[12])
            except (OSError, IndexError, ValueError):
                continue
        return total / tick

    pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    c0 = cpu()
    time.sleep(idle_s)
    gpu = {p: m for p, m in gpu_apps().items() if int(p) in pids}
    return {"processes": len(pids), "host_pss_bytes": pss,
            "cpu_s_idle": round(cpu() - c0, 3), "idle_s": idle_s,
            "gpu_mib": sum(gpu.values())}


def standby_kills(hcfg: dict, work: Path, runs: int, woken: bool = False) -> list[dict]:
    """An agent with snapshots.standby over the holder the hybrid runs used (its store has
    their snapshot): before each of `runs` SIGKILLs it waits for the standby armed, says
    what the standby costs and how soon it was re-armed, and each recovery is timed as
    `recover` times the others (no first-token requests after it: they would delay the
    bench's look at the next standby, and so the re-arm time it reads)."""
    cfg = {**hcfg, "snapshots": {**hcfg["snapshots"], "enabled": True, "standby": True,
                                 "standby_woken": woken}}
    agent = Agent(cfg, work)
    out: list[dict] = []
    try:
        agent.wait(lambda s: s.get("state") == "ready", 900, "first start (standby)")
        for n in range(1, runs + 1):
            agent.wait_standby_armed(900, f"the standby armed before kill {n}")
            # Re-armed this long after the engine it follows was ready (none before kill 1).
            rearm = round(time.time() - out[-1]["at"], 3) if out else None
            costs = standby_costs(agent)
            log(f"standby costs {costs}, re-armed after {rearm} s")
            out.append({**recover(agent, n, None), "standby_costs": costs,
                        "rearmed_after_s": rearm})
    finally:
        agent.stop()
    return out


def machine() -> tuple[str, str]:
    """The result-row machine class ("h200", "cpu-2core", ...) and the host in words."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader", "-i", "0"], capture_output=True,
                             text=True, timeout=30)
        gpu = out.stdout.strip() if out.returncode == 0 else "no GPU"
    except OSError:
        gpu = "no GPU"
    if "H200" in gpu:
        kind = "h200"
    elif gpu == "no GPU":
        kind = f"cpu-{os.cpu_count()}core"
    else:
        kind = gpu.split(",")[0].strip().lower()
    return kind, (f"{os.uname().nodename} ({gpu}, kernel {os.uname().release}, THP {thp()}, "
                  f"/run {run_fs()})")


def run_fs() -> str:
    """The file system of the host's /run: CRIU keeps its kernel probe between runs only
    where it is a tmpfs (as systemd mounts it), and probes again on every run elsewhere."""
    from agent.doctor import fs_type

    return fs_type(Path("/run"), Path("/proc/self/mountinfo")) or "unknown"


def thp() -> str:
    """The host's transparent huge page mode for anonymous memory (always, madvise, never):
    CRIU restores pages faster into huge pages, and the kernel role sets `always`."""
    from agent.doctor import thp_mode

    return thp_mode() or "unknown"


H2D_SCRIPT = """
import sys, time, torch
n = int(float(sys.argv[1]) * 2**30)
src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
best = 0.0
for _ in range(6):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = max(best, n / (time.perf_counter() - t0))
print(best / 1e9)
"""


def pinned_h2d_gbps(device: str, gib: float) -> float | None:
    """The host's pinned host-to-device copy rate, GB/s (best of 6 copies of `gib` GiB)."""
    if device != "cuda" or gib <= 0:
        return None
    out = subprocess.run([sys.executable, "-c", H2D_SCRIPT, str(gib)], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        log(f"pinned host-to-device measurement failed: {out.stderr[-500:]}")
        return None
    return round(float(out.stdout.strip()), 2)


# Stage names of the refill rung that hold the weight load itself (the rest is the restore).
LOAD_STAGES = ("refill", "refill_load", "load")


def load_seconds(rec: dict) -> float | None:
    """Seconds the refill's weight load took in one recovery, from its stages."""
    secs = [v for k, v in rec.get("stages", {}).items() if k in LOAD_STAGES]
    return sum(secs) if secs else None


def stage_medians(recs: list[dict]) -> dict[str, float]:
    names = {k for r in recs for k in r.get("stages", {})}
    return {k: round(statistics.median(r["stages"].get(k, 0.0) for r in recs), 4)
            for k in sorted(names)}


def refill_figures(recs: list[dict], weights_bytes: int, h2d: float | None) -> dict:
    loads = [s for s in (load_seconds(r) for r in recs) if s]
    if not loads:
        return {"load_s": [], "load_gbps": None, "pinned_h2d_gbps": h2d, "load_vs_pinned": None}
    gbps = weights_bytes / statistics.median(loads) / 1e9
    return {"load_s": loads, "load_gbps": round(gbps, 2), "pinned_h2d_gbps": h2d,
            "load_vs_pinned": round(gbps / h2d, 3) if h2d else None}


# The five the bench was made for (its default), and the standby (issue 34) beside them.
PATHS = ("cold", "warm", "full", "refill", "hybrid", "standby", "standby-woken")
DEFAULT_PATHS = PATHS[:5]


def client_figures(recs: list[dict]) -> dict:
    """What a client saw of the recoveries that were timed from outside: SIGKILL -> the
    next answer through the front, whether it was the answer before, and where the seconds
    went (median of each part)."""
    k2a = [r["kill_to_answer_s"] for r in recs if r.get("kill_to_answer_s") is not None]
    if not k2a:
        return {}
    parts = [r["kill_breakdown"] for r in recs if r.get("kill_breakdown")]
    return {"kill_to_answer_s": k2a, "kill_to_answer_median_s": statistics.median(k2a),
            "same_answer": [r.get("same_answer") for r in recs],
            "kill_breakdown_median_s": {k: round(statistics.median(p[k] for p in parts), 4)
                                        for k in (parts[0] if parts else {})}}


def rows(result: dict, gib: float, command: str) -> list[dict]:
    """One row per recovery path measured: times, stages, peak GPU memory, both first-token
    figures; the refill row also its load rate against the pinned host-to-device rate. A
    refill run the ladder walked past (to another rung) is not a refill: it is listed in
    the row's `fell_to`, not in its times."""
    out = []
    where, host = machine()
    for path in PATHS:
        recs = [r for r in result.get(path, []) if r.get("result") == "success"]
        fell_to = []
        if path == "refill":
            fell_to = [r["path"] for r in recs if r.get("path") != "refill"]
            recs = [r for r in recs if r.get("path") == "refill"]
        if not recs:
            continue
        runs = [r["duration_s"] for r in recs]
        peaks = [r["gpu_peak_bytes"] for r in recs if r.get("gpu_peak_bytes") is not None]
        after = [r["first_token_after_recovery_s"] for r in recs
                 if r.get("first_token_after_recovery_s") is not None]
        steady = [r["first_token_steady_s"] for r in recs
                  if r.get("first_token_steady_s") is not None]
        out.append({
            "engine": "reference", "path": path, "gib": gib, "runs_s": runs,
            "median_s": statistics.median(runs), "machine": where, "host": host,
            "command": command,
            "gpu_peak_bytes": peaks,
            "gpu_peak_median_bytes": statistics.median(peaks) if peaks else None,
            "first_token_after_recovery_s": after,
            "first_token_after_recovery_median_s": statistics.median(after) if after else None,
            "first_token_steady_s": steady,
            "first_token_steady_median_s": statistics.median(steady) if steady else None,
            "stages_median_s": stage_medians(recs),
            "canary_method": result.get("canary_method"),
            **client_figures(recs),
            **({"fell_to": [r["path"] for r in recs if r.get("path") != "standby"],
                "standby_costs": [r.get("standby_costs") for r in recs],
                "rearmed_after_s": [r["rearmed_after_s"] for r in recs
                                    if r.get("rearmed_after_s") is not None]}
               if path.startswith("standby") else {}),
            **({"fell_to": fell_to, **refill_figures(recs, result["weights_bytes"],
                                                     result.get("pinned_h2d_gbps"))}
               if path == "refill" else {}),
            # The image these restores read: its size and what the engine said it held.
            **({"image_bytes": snap.get("image_bytes"), "footprint": snap.get("footprint")}
               if (snap := result.get("snapshot" if path == "full" else "hybrid_snapshot"))
               and path in ("hybrid", "refill", "full") else {}),
        })
    return out


def gpu_id(device: str) -> str:
    if device != "cuda":
        return "cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def start_holder(gpu: str, holder_dir: Path, workdir: Path, *extra: str) -> subprocess.Popen:
    backend = "cpu" if gpu == "cpu" else "cuda"
    p = subprocess.Popen([sys.executable, "-m", "agent", "holder", "--backend", backend,
                          "--gpu", gpu, "--dir", str(holder_dir), *extra], cwd=REPO,
                         stdout=(workdir / "holder.log").open("ab"), stderr=subprocess.STDOUT)
    sock = holder_dir / gpu / "holder.sock"
    end = time.monotonic() + 60
    while not sock.exists():
        if p.poll() is not None or time.monotonic() > end:
            raise SystemExit(f"holder did not start: {(workdir / 'holder.log').read_text()}")
        time.sleep(0.1)
    return p


def stop_process(p: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not gone within `grace_s`."""
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def stop_holder(holder: subprocess.Popen) -> None:
    """SIGTERM (it frees what it holds), SIGKILL if it has not gone in two minutes."""
    stop_process(holder, 120)


def restart_holder(holder: subprocess.Popen, gpu: str, holder_dir: Path,
                   workdir: Path) -> subprocess.Popen:
    stop_holder(holder)
    (holder_dir / gpu / "holder.sock").unlink(missing_ok=True)
    # Empty when the engine dies: a holder left to refill at its start would race the kill.
    return start_holder(gpu, holder_dir, workdir, "--no-refill")


def canary_method(state_dir: Path) -> str | None:
    """How the agent's canary record was made (an older agent's record names none)."""
    try:
        return json.loads((state_dir / "canary.json").read_text()).get("method",
                                                                       "engine_default")
    except (OSError, ValueError):
        return None


def full_fits(snapshot_dir: Path, weights_bytes: int, kv_gib: float) -> str:
    """Why a full image cannot be written under `snapshot_dir`, or "" when it can."""
    probe = snapshot_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(weights_bytes * 1.05) + int(kv_gib * 2**30) + (2 << 30)
    if free < need:
        return (f"a full image of about {need / 1e9:.0f} GB does not fit in the "
                f"{free / 1e9:.0f} GB free under {probe}")
    return ""


def first_snapshot(agent: Agent) -> dict:
    agent.wait(lambda s: "published" in s.get("reason", "")
               or "failed" in s.get("reason", ""), 900, "snapshot")
    snaps = snapshots(agent.path)
    if not snaps:
        raise SystemExit("no snapshot was published; see agent.log")
    m = manifest(agent.path, snaps[0]["id"])
    snap = {"id": m["id"], "kind": m.get("kind"),
            "image_bytes": sum(f["size"] for f in m["files"]), "timings": m["timings"],
            # Where the image's bytes are (CRIU's pages-N.img per process dominate).
            "largest_files": {f["name"]: f["size"] for f in
                              sorted(m["files"], key=lambda f: -f["size"])[:6]},
            **prepare_lines(agent.path.parent / "agent.log")}
    paths = agent.cfg["paths"]
    image = Path(paths.get("snapshot_dir") or Path(paths["state_dir"]) / "snapshots") / m["id"]
    snap["zero_pages"] = zero_pages(image, list(snap["largest_files"])[:3])
    # Each process's GPU memory now (the engine serves again, as at the dump but with its
    # caches refilled): beside torch's figures above, what its CUDA context holds.
    snap["gpu_apps_mib"] = gpu_apps()
    # What the agent left out of the image after the dump (a hybrid image only).
    said = [x for x in (agent.path.parent / "agent.log").read_text(errors="replace")
            .splitlines() if "all-zero pages" in x]
    snap["zero_pages_left_out"] = said[-1].split("pitstop.snapshot: ", 1)[-1] if said else None
    log(f"snapshot {snap}")
    return snap


def gpu_apps() -> dict[str, int]:
    """PID -> MiB of GPU memory for every compute process, as nvidia-smi lists them."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    apps = {}
    for line in out.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if mib.strip().isdigit():
            apps[pid.strip()] = int(mib)
    return apps


def zero_pages(image: Path, names: list[str]) -> dict:
    """Of each of CRIU's pages-N.img named: its 4 KiB pages, and how many are all zeros
    (memory a restore reads back although a fresh mapping would hold it already)."""
    out = {}
    zero = bytes(4096)
    for name in names:
        path = image / name
        if not name.startswith("pages-") or not path.exists():
            continue
        pages = zeros = 0
        with path.open("rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                for i in range(0, len(chunk), 4096):
                    pages += 1
                    zeros += chunk[i:i + 4096] == zero
        out[name] = {"pages": pages, "zero": zeros}
    return out


def prepare_lines(agent_log: Path) -> dict:
    """What the engine said at the snapshot's prepare (the last one in the agent's log):
    its lines, and the figures of its footprint line (torch's reserved and allocated GPU
    bytes, the GPU's free bytes, host RSS by kind, graphs, the per-thread stack), which
    say what the image is made of beside CRIU's pages-N.img sizes."""
    lines = agent_log.read_text(errors="replace").splitlines()
    starts = [i for i, x in enumerate(lines) if "prepare: KV pool freed" in x]
    if not starts:
        return {"prepare_log": [], "footprint": {}}
    mine = [x for x in lines[starts[-1]:] if "prepare:" in x][:8]
    figures: dict = {}
    for x in mine:
        if "image footprint " in x:
            head = x.split("image footprint ", 1)[1].split(" (", 1)[0]
            for pair in head.split():
                k, _, v = pair.partition("=")
                figures[k] = int(v) if v.lstrip("-").isdigit() else None
    return {"prepare_log": mine, "footprint": figures}


def starts(cfg: dict, work: Path, runs: int, what: str, steady: int) -> list[dict]:
    """An agent with snapshots off: its first start, then `runs - 1` recoveries from kills."""
    agent = Agent({**cfg, "snapshots": {**cfg["snapshots"], "enabled": False}}, work)
    try:
        st = agent.wait(lambda s: s.get("state") == "ready", 900, what)
        log(f"{what} {st['last_recovery']}")
        first = {**st["last_recovery"], **first_tokens(agent, steady)}
        return [first] + [recover(agent, n, steady) for n in range(1, runs)]
    finally:
        agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/pitstop-models"))
    ap.add_argument("--work", type=Path, default=Path("/root/pitstop-bench"))
    ap.add_argument("--snapshot-dir", type=Path, default=None,
                    help="default: on disk under --work")
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                    help=f"any of {', '.join(PATHS)}")
    ap.add_argument("--h2d-gib", type=float, default=4.0,
                    help="GiB of pinned memory copied to the GPU to measure the host's rate")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--steady-requests", type=int, default=5,
                    help="streamed requests after the first one following each recovery")
    ap.add_argument("--engine-args", default="",
                    help="more reference-engine arguments, e.g. --engine-args=--prepare-stack=1024")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.gib:g}gib"
    result: dict = {"gib": a.gib, "runs": a.runs, "host": os.uname().nodename}

    model = a.models / tag
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(model), "--target-gib",
                    str(a.gib)], cwd=REPO, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": a.device})
    result["make_model_s"] = round(time.monotonic() - t0, 2)
    result["weights_bytes"] = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    log(f"model {model}: {result['weights_bytes'] / 1e9:.2f} GB in {result['make_model_s']}s")

    work = a.work / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = {
        "engine": {"kind": "reference", "model": str(model), "device": a.device,
                   "args": [*kv_args(model, a.kv_gib, a.max_len), *a.engine_args.split()],
                   "stop_timeout_s": 30},
        "paths": {"state_dir": str(work / "state")},
        # The front measures the first token after each recovery (first_tokens()).
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"start_timeout_s": 900, "timeout_s": 5},
        "snapshots": {"drift_check_interval_s": 0, "quiet_timeout_s": 60},
        # Every kill here is the bench's own: hybrid and refill together are 2 x --runs of
        # them within a minute, which the default limit (5 in 300 s) calls a crash loop.
        # Nor is a second kill a crash loop's: no backoff before its recovery (the agent's
        # default waits 0.5 s, doubling, before the second restart in its window).
        "restart": {"crash_loop_limit": 1000, "backoff_initial_s": 0},
    }
    if a.snapshot_dir:
        shutil.rmtree(a.snapshot_dir, ignore_errors=True)
        cfg["paths"]["snapshot_dir"] = str(a.snapshot_dir)
    paths = a.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    result["pinned_h2d_gbps"] = pinned_h2d_gbps(a.device, a.h2d_gib)
    log(f"pinned host-to-device copy: {result['pinned_h2d_gbps']} GB/s")
    result["skipped"] = {}
    if "full" in paths:
        why = full_fits(a.snapshot_dir or work, result["weights_bytes"], a.kv_gib)
        if why:
            result["skipped"]["full"] = why
            log(f"full restore skipped: {why}")
            paths.remove("full")

    # The holder's paths first: hybrid is the one this bench is for, and a run cut short
    # keeps it.
    if {"hybrid", "refill", "warm", "standby", "standby-woken"} & set(paths):
        gpu = gpu_id(a.device)
        holder_dir = work / "holder"
        holder = start_holder(gpu, holder_dir, work)
        result["holder_pid"] = holder.pid  # to tell it from the engine in gpu_apps_mib
        hcfg = {**cfg, "holder": {"enabled": True, "dir": str(holder_dir), "gpu": gpu},
                "paths": {"state_dir": str(work / "state-holder")},
                "snapshots": {**cfg["snapshots"],
                              "enabled": "hybrid" in paths or "refill" in paths}}
        try:
            agent = Agent(hcfg, work)
            try:
                st = agent.wait(lambda s: s.get("state") == "ready", 900, "first start")
                result["holder_first"] = st["last_recovery"]
                log(f"first start (fills the holder) {st['last_recovery']}")
                if "hybrid" in paths or "refill" in paths:
                    result["hybrid_snapshot"] = first_snapshot(agent)
                done = a.runs if "hybrid" in paths else 0
                if "hybrid" in paths:
                    result["hybrid"] = [recover(agent, n, a.steady_requests)
                                        for n in range(1, a.runs + 1)]
                    save(result, a, tag, finished=False)
                if "refill" in paths:
                    result["refill"] = []
                    for n in range(done + 1, done + 1 + a.runs):
                        # The holder restarted empty (as after a reboot or a holder crash),
                        # then the engine dies: the ladder finds the hybrid image valid and
                        # the held weights gone.
                        holder = restart_holder(holder, gpu, holder_dir, work)
                        result["refill"].append(recover(agent, n, a.steady_requests))
                        save(result, a, tag, finished=False)
                    result["refill_fell_to"] = [r["path"] for r in result["refill"]
                                                if r.get("path") != "refill"]
                result["canary_method"] = canary_method(Path(hcfg["paths"]["state_dir"]))
                save(result, a, tag, finished=False)
            finally:
                agent.stop()
            for path in ("standby", "standby-woken"):
                if path in paths:  # woken: snapshots.standby_woken, the copy run ahead
                    result[path] = standby_kills(hcfg, work, a.runs, path == "standby-woken")
                    save(result, a, tag, finished=False)
            if "warm" in paths:
                result["warm"] = starts(hcfg, work, a.runs, "warm start", a.steady_requests)
        finally:
            stop_holder(holder)
        save(result, a, tag, finished=False)

    if "full" in paths:
        agent = Agent(cfg, work)
        try:
            st = agent.wait(lambda s: s.get("state") == "ready", 900, "first start")
            result["first_cold"] = st["last_recovery"]
            log(f"cold start {st['last_recovery']['duration_s']:.2f}s")
            result["snapshot"] = first_snapshot(agent)
            result["full"] = [recover(agent, n, a.steady_requests)
                              for n in range(1, a.runs + 1)]
        finally:
            agent.stop()
        log_text = (work / "agent.log").read_text(errors="replace")
        result["freed_lines"] = [x for x in log_text.splitlines() if "freed" in x][-2:]
        save(result, a, tag, finished=False)

    if "cold" in paths:
        result["cold"] = starts(cfg, work, a.runs, "cold start", a.steady_requests)
        save(result, a, tag, finished=False)

    save(result, a, tag)
    log("wrote", a.out / f"recovery-{tag}.json")


def save(result: dict, a: argparse.Namespace, tag: str, finished: bool = True) -> None:
    """The result so far: written after each path, so a run cut short keeps what it measured."""
    result["rows"] = rows(result, a.gib, " ".join(["python3", *sys.argv]))
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) if finished else None
    (a.out / f"recovery-{tag}.json").write_text(json.dumps(result, indent=1))
    work = a.work / tag
    for name in ("agent", "holder"):
        if (work / f"{name}.log").exists():
            shutil.copy(work / f"{name}.log", a.out / f"{name}-{tag}.log")


if __name__ == "__main__":
    main()
