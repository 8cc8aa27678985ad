"""The holder's refill load alone, its knobs swept in one run, against the host's own copy
rate measured in the same run.

Each combination of `--threads`, `--piece-mib`, `--buffers` and `--host`
(agent/holder/refill/__init__.py `Tuning`) loads the model's safetensors files from the page cache
the way the holder does (the sink made first, the regions created meanwhile, then the
job), in this process, `--runs` times; the first run's bytes are compared with the files
(1 MiB at the start, middle and end of each region); every run's regions are freed. Then
`--holder-runs` loads through a real `pitstop holder` (socket, plan check, commit) with its
defaults. cuda: the reference is cuMemcpyHtoD from pinned host memory (`--h2d-gib`, best
of 6), what an ideal refill would reach; `--fastsafetensors DIR` (an unpacked
fastsafetensors wheel) adds its nogds loader on the same files. cpu: only --threads and
--piece-mib mean anything (reads land in the memfds). Not part of `make test`. From the
repository root:

    python3 bench/refill_bench.py OUT --backend cuda --gib 32 --models /dev/shm/models \
        --threads 8,16 --piece-mib 4,16,64 --host pinned,huge,wc,direct --runs 2
    python3 bench/refill_bench.py OUT --backend cpu --gib 0.05 --models /tmp/m --threads 1,2

The model is `MODELS/<gib>gib`, made by `pitstop make-model` as bench/gpu_recovery_bench.py
makes it (so one made there is reused). Writes OUT/refill-<backend>.json: `rows` in the
result-row format, one per combination (with load_gbps, pinned_h2d_gbps, load_vs_pinned
and the median seconds of each step), `best`, the fastest combination, and `not_run`
when `--budget-s` ended the sweep early.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.holder.client import HolderClient  # noqa: E402
from agent.holder.refill import DEFAULT_TUNING, Host, Tuning  # noqa: E402
from agent.holder.refill.job import RefillJob, make_sink  # noqa: E402
from agent.holder.weightplan import RefillPlan, build_plan, write_plan  # noqa: E402
from agent.weights import FileDigest, is_model_file, manifest_digest  # noqa: E402

SAMPLE = 1 << 20


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def model_dir(models: Path, gib: float, device: str) -> Path:
    """`models/<gib>gib`, made (or found already made) as bench/gpu_recovery_bench.py does."""
    model = models / f"{gib:g}gib"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(model), "--target-gib",
                    str(gib)], cwd=REPO, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": device})
    log(f"model {model} ready in {time.monotonic() - t0:.1f}s")
    return model


def warm(files: list[Path], threads: int = 16) -> float:
    """Read every file once on `threads` threads (into the page cache): GB/s."""
    def one(p: Path) -> int:
        buf, n = bytearray(64 << 20), 0
        with p.open("rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(one, files))
    return n / (time.perf_counter() - t0) / 1e9


def read_one_thread(files: list[Path], limit: int = 4 << 30) -> float:
    """One thread reading the files (their first `limit` bytes) into a reused buffer: GB/s,
    what one core copies out of the page cache (the cpu reference)."""
    buf, n = bytearray(64 << 20), 0
    t0 = time.perf_counter()
    for p in files:
        with p.open("rb", buffering=0) as f:
            while n < limit and (k := f.readinto(buf)):
                n += k
    return n / (time.perf_counter() - t0) / 1e9


def _ck(r):  # noqa: ANN001, ANN202 - a cuda-bindings result
    err, *v = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        raise RuntimeError(f"{err}")
    return v[0] if v else None


def pinned_h2d_gbps(nbytes: int, reps: int = 6) -> float:
    """cuMemcpyHtoD from one pinned buffer to device memory, best of `reps`, in GB/s."""
    from cuda.bindings import driver as cu

    _ck(cu.cuInit(0))
    dev = _ck(cu.cuDeviceGet(0))
    ctx = _ck(cu.cuDevicePrimaryCtxRetain(dev))
    _ck(cu.cuCtxSetCurrent(ctx))
    host = _ck(cu.cuMemHostAlloc(nbytes, 0))
    devp = _ck(cu.cuMemAlloc(nbytes))
    best = 0.0
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            _ck(cu.cuMemcpyHtoD(devp, host, nbytes))
            _ck(cu.cuCtxSynchronize())
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        _ck(cu.cuMemFree(devp))
        _ck(cu.cuMemFreeHost(host))
        _ck(cu.cuDevicePrimaryCtxRelease(dev))
    return best


def samples(region_size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes compared: the start, the middle and the end."""
    return sorted({(off, min(SAMPLE, region_size - off))
                   for off in (0, region_size // 2, max(0, region_size - SAMPLE))})


def expected(plan: RefillPlan, r, off: int, k: int) -> bytes:  # noqa: ANN001 - a PlanRegion
    with open(Path(plan.model) / r.file, "rb") as f:
        f.seek(r.offset + off)
        return f.read(k)


def verify(backend, plan: RefillPlan, allocations: list) -> int:  # noqa: ANN001 - a Backend
    """Compare samples of every loaded region with its file; the samples compared."""
    n = 0
    if backend.name == "cpu":
        import mmap

        for r, a in zip(plan.regions, allocations, strict=True):
            with mmap.mmap(a.fds[0], a.size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                for off, k in samples(r.size):
                    if m[off:off + k] != expected(plan, r, off, k):
                        raise SystemExit(f"{r.name}: bytes at {off} differ from the file")
                    n += 1
        return n
    from cuda.bindings import driver as cu

    from agent.tenant.mapping_cuda import CudaSpace

    # One context for all the regions (each CudaSpace retains the primary one again).
    dev = _ck(cu.cuDeviceGet(backend.ordinal))
    _ck(cu.cuDevicePrimaryCtxRetain(dev))
    try:
        for r, a in zip(plan.regions, allocations, strict=True):
            space = CudaSpace(a.size, backend.align, device=backend.ordinal)
            try:
                space.map(0, a.fds, a.chunks)
                for off, k in samples(r.size):
                    got = bytearray(k)
                    _ck(cu.cuMemcpyDtoH(got, space.base + off, k))
                    if bytes(got) != expected(plan, r, off, k):
                        raise SystemExit(f"{r.name}: bytes at {off} differ from the file")
                    n += 1
            finally:
                space.close()
    finally:
        _ck(cu.cuDevicePrimaryCtxRelease(dev))
    return n


def load_once(backend, plan: RefillPlan, tuning: Tuning,  # noqa: ANN001 - a Backend
              check: bool) -> dict:
    """One load in the holder's order: the sink, the regions meanwhile, then the job; its
    bytes compared with the files when `check`. The load's error, if any, in `error`."""
    done = threading.Event()
    t0 = time.perf_counter()
    sink = make_sink(backend, tuning)
    allocations = [backend.allocate(r.name, r.size) for r in plan.regions]
    create_s = time.perf_counter() - t0
    job = RefillJob(plan, allocations, sink, on_done=done.set, tuning=tuning)
    job.start()
    job.join()
    total = time.perf_counter() - t0
    try:
        if job.error is not None:
            return {"error": str(job.error)}
        checked = verify(backend, plan, allocations) if check else 0
    finally:
        t1 = time.perf_counter()
        for a in allocations:
            backend.free(a)
        free_s = time.perf_counter() - t1
    return {"total_s": total, "stages": {"create_s": create_s, **job.timings},
            "free_s": free_s, "checked": checked}


class HolderProc:
    def __init__(self, backend: str, gpu: str, base: Path, logf: Path):
        self.p = subprocess.Popen([sys.executable, "-m", "agent", "holder", "--backend", backend,
                                   "--gpu", gpu, "--dir", str(base), "--no-refill"],
                                  cwd=REPO, stdout=logf.open("ab"), stderr=subprocess.STDOUT)
        self.sock = base / gpu / "holder.sock"
        deadline = time.monotonic() + 60
        while True:
            try:
                with HolderClient(self.sock, timeout=5) as c:
                    c.stats()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.p.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"holder did not start: {logf.read_text()[-2000:]}") \
                        from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        self.p.wait(120)


def holder_runs(backend: str, gpu: str, plan: RefillPlan, work: Path, runs: int) -> list[float]:
    """Loads through a real `pitstop holder` with its defaults: seconds from the request
    to the answer."""
    secs = []
    for i in range(runs):
        h = HolderProc(backend, gpu, work / "holder", work / "holder.log")
        try:
            write_plan(h.sock.parent, plan)
            t0 = time.perf_counter()
            with HolderClient(h.sock, timeout=600) as c:
                done = c.refill(plan.digest)
            secs.append(time.perf_counter() - t0)
            log(f"holder run {i + 1}: {done.bytes / 1e9:.2f} GB in {done.seconds:.3f}s in the "
                f"holder, {secs[-1]:.3f}s from the request to the answer")
        finally:
            h.stop()
    return secs


FST_SCRIPT = """
import json, sys, time, torch
t0 = time.perf_counter()
torch.empty(1, device="cuda"); torch.cuda.synchronize()
ctx = time.perf_counter() - t0
from fastsafetensors import SafeTensorsFileLoader
files = sys.argv[3:]
threads, bbuf_kb = int(sys.argv[1]), int(sys.argv[2])
t1 = time.perf_counter()
loader = SafeTensorsFileLoader(None, "cuda:0", nogds=True, max_threads=threads,
                               bbuf_size_kb=bbuf_kb)
loader.add_filenames({0: files})
fb = loader.copy_files_to_device()
torch.cuda.synchronize()
load = time.perf_counter() - t1
fb.close(); loader.close()
print(json.dumps({"context_s": ctx, "load_s": load}))
"""


def fastsafetensors(path: Path, files: list[Path], threads: int, runs: int,
                    work: Path) -> dict:
    """fastsafetensors' nogds loader (pread into pinned bounce buffers, C++ threads) on the
    same files, in a fresh process each run: its load seconds after torch made a context
    (the holder's figures include making one)."""
    # It dlopens "libcudart.so"; torch's wheels ship only libcudart.so.<major>.
    libs = work / "cudart"
    libs.mkdir(exist_ok=True)
    found = [q for p in map(Path, sys.path) if p.is_dir()
             for q in p.glob("nvidia/*/lib/libcudart.so*")]
    if found and not (libs / "libcudart.so").exists():
        (libs / "libcudart.so").symlink_to(found[0])
    env = {**os.environ, "PYTHONPATH": f"{path}:{os.environ.get('PYTHONPATH', '')}",
           "LD_LIBRARY_PATH": f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    # Bounce buffers as much pinned memory as the holder's default load takes.
    bbuf_kb = DEFAULT_TUNING.threads * DEFAULT_TUNING.buffers * DEFAULT_TUNING.piece >> 10
    loads, ctx = [], []
    for _ in range(runs):
        try:
            out = subprocess.run([sys.executable, "-c", FST_SCRIPT, str(threads), str(bbuf_kb),
                                  *map(str, files)], capture_output=True, text=True, env=env,
                                 timeout=90)
        except subprocess.TimeoutExpired:
            return {"error": "no load within 90 s"}
        if out.returncode != 0:
            return {"error": out.stderr.strip()[-800:]}
        r = json.loads(out.stdout.strip().splitlines()[-1])
        loads.append(r["load_s"])
        ctx.append(r["context_s"])
    return {"runs_s": loads, "median_s": statistics.median(loads), "threads": threads,
            "bounce_kib": bbuf_kb, "torch_context_s": ctx}


def host_facts(model: Path) -> dict:
    """What the page cache's speed depends on: cores, THP for anonymous and shmem memory,
    and the mount the model's files are on (tmpfs with huge= or not)."""
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError as e:
            return f"unreadable: {e.strerror}"

    mount, best = "", ""
    for line in read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) >= 4 and str(model.resolve()).startswith(parts[1]) and \
                len(parts[1]) > len(best):
            best, mount = parts[1], f"{parts[1]} {parts[2]} {parts[3]}"
    return {"cpus": os.cpu_count(), "mount": mount,
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_shmem": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")}


def gpu_uuid() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


def machine(backend: str) -> str:
    if backend == "cuda":
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                              "-i", "0"], capture_output=True, text=True, timeout=30)
        return "h200" if "H200" in out.stdout else out.stdout.strip().lower()
    return f"cpu-{os.cpu_count()}core"


def tuning_fields(t: Tuning) -> dict:
    return {"threads": t.threads, "piece_mib": t.piece / (1 << 20), "buffers": t.buffers,
            "host": t.host.value}


def row(a: argparse.Namespace, gib: float, plan: RefillPlan, secs: list[float], ref: dict,
        **extra: object) -> dict:
    median = statistics.median(secs)
    gbps = plan.bytes / median / 1e9
    pinned = ref.get("pinned_h2d_gbps")
    return {"engine": "holder", "path": "refill-load", "gib": gib,
            "runs_s": [round(s, 4) for s in secs], "median_s": round(median, 4),
            "machine": machine(a.backend),
            "command": " ".join(["python3", "bench/refill_bench.py", *sys.argv[1:]]),
            "backend": a.backend, "bytes": plan.bytes, "load_gbps": round(gbps, 2),
            "pinned_h2d_gbps": pinned,
            "load_vs_pinned": round(gbps / pinned, 3) if pinned else None,
            **({"read_one_thread_gbps": ref["read_one_thread_gbps"]}
               if "read_one_thread_gbps" in ref else {}),
            **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/pitstop-models"),
                    help="where MODELS/<gib>gib is (or is made); as gpu_recovery_bench.py's")
    d = DEFAULT_TUNING
    ap.add_argument("--threads", default=str(d.threads), help="comma list")
    ap.add_argument("--piece-mib", default=str(d.piece >> 20), help="comma list")
    ap.add_argument("--buffers", default=str(d.buffers), help="host buffers per thread "
                    "(registrations in flight when direct), comma list")
    ap.add_argument("--host", default=d.host.value, help="where pieces wait for their copy, "
                    f"comma list of {', '.join(h.value for h in Host)} "
                    "(agent/holder/refill/__init__.py Host)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each combination")
    ap.add_argument("--holder-runs", type=int, default=1,
                    help="loads through a real `pitstop holder` with its defaults")
    ap.add_argument("--h2d-gib", type=float, default=4.0)
    ap.add_argument("--fastsafetensors", type=Path, metavar="DIR",
                    help="an unpacked fastsafetensors wheel: measure its nogds loader too")
    ap.add_argument("--modelgen-device", choices=["cpu", "cuda"],
                    help="where make-model makes the weights (default: the backend's)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="stop starting combinations after this many seconds of sweep")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    work.mkdir(exist_ok=True)

    model = model_dir(a.models, a.gib, a.modelgen_device or a.backend)
    names = sorted(n for n in os.listdir(model) if is_model_file(n))
    # Placeholders for sha256: a refill checks the files' stat keys, it does not hash them.
    digests = tuple(FileDigest(n, (model / n).stat().st_size, "0" * 64) for n in names)
    plan = build_plan(model, digests, manifest_digest(digests))
    files = [model / r.file for r in plan.regions]
    log(f"{plan.bytes / 1e9:.2f} GB in {len(files)} files; warmed at "
        f"{warm(files):.1f} GB/s")

    ref: dict = {}
    facts = host_facts(model)
    log(f"host: {facts}")
    if a.backend == "cuda":
        ref["pinned_h2d_gbps"] = round(pinned_h2d_gbps(int(a.h2d_gib * (1 << 30))), 2)
        log(f"pinned cuMemcpyHtoD: {ref['pinned_h2d_gbps']} GB/s")
    ref["read_one_thread_gbps"] = round(read_one_thread(files), 2)
    log(f"one thread reading the files: {ref['read_one_thread_gbps']} GB/s")

    from agent.holder.backends import make_backend

    gpu = gpu_uuid() if a.backend == "cuda" else "cpu"
    backend = make_backend(a.backend, gpu)
    # cpu: reads land in the memfds, so only threads and piece matter there.
    cuda = a.backend == "cuda"
    hosts = [Host(h) for h in a.host.split(",") if h]
    combos = list(dict.fromkeys(
        Tuning(threads=t, piece=p << 20, buffers=b if cuda else DEFAULT_TUNING.buffers,
               host=h if cuda else DEFAULT_TUNING.host)
        for t, p, b, h in itertools.product(ints(a.threads), ints(a.piece_mib),
                                            ints(a.buffers), hosts)))
    # The holder's default first, then in the order of --host: what --budget-s leaves out
    # is what was named last.
    combos.sort(key=lambda t: (t != DEFAULT_TUNING, hosts.index(t.host)))
    rows, left = [], []
    t_sweep = time.monotonic()
    for tuning in combos:
        if time.monotonic() - t_sweep > a.budget_s:
            left.append(tuning)
            continue
        runs = [load_once(backend, plan, tuning, check=i == 0) for i in range(a.runs)]
        failed = [r["error"] for r in runs if "error" in r]
        if failed:
            log(f"{tuning}: failed: {failed[0]}")
            rows.append({**tuning_fields(tuning), "error": failed[0]})
            continue
        secs = [r["total_s"] for r in runs]
        stages = {k: round(statistics.median(r["stages"].get(k, 0.0) for r in runs), 4)
                  for k in sorted({k for r in runs for k in r["stages"]})}
        # The reads and copies alone, past the setup: what the pipeline itself reaches.
        read_gbps = plan.bytes / stages["read_s"] / 1e9 if stages.get("read_s") else None
        rows.append(row(a, a.gib, plan, secs, ref, **tuning_fields(tuning), stages=stages,
                        read_gbps=read_gbps and round(read_gbps, 2),
                        free_s=round(statistics.median(r["free_s"] for r in runs), 4),
                        checked_samples=sum(r["checked"] for r in runs),
                        default=tuning == DEFAULT_TUNING))
        r = rows[-1]
        log(f"{tuning}: median {r['median_s']:.3f}s, {r['load_gbps']} GB/s (reads and "
            f"copies alone {r['read_gbps']} GB/s)"
            + (f" ({100 * r['load_vs_pinned']:.0f}% of pinned)" if r["load_vs_pinned"] else "")
            + f"; {stages}")
    if a.holder_runs > 0:
        secs = holder_runs(a.backend, gpu, plan, work, a.holder_runs)
        rows.append(row(a, a.gib, plan, secs, ref, **tuning_fields(DEFAULT_TUNING), default=True,
                        through="pitstop holder (request to answer)"))
    result: dict = {"rows": rows, **ref, "host": facts}
    if left:
        result["not_run"] = {"combinations": [str(t) for t in left],
                             "why": f"--budget-s {a.budget_s:g} spent before they started"}
    if a.fastsafetensors and a.backend == "cuda":
        fst = fastsafetensors(a.fastsafetensors.resolve(), files, DEFAULT_TUNING.threads,
                              a.runs, work)
        if "median_s" in fst:
            gbps = plan.bytes / fst["median_s"] / 1e9
            fst.update(load_gbps=round(gbps, 2),
                       load_vs_pinned=round(gbps / ref["pinned_h2d_gbps"], 3))
        result["fastsafetensors"] = fst
        log(f"fastsafetensors: {fst}")
    swept = [r for r in rows if "through" not in r and "error" not in r]
    if swept:
        best = min(swept, key=lambda r: r["median_s"])
        result["best"] = {k: best[k] for k in (*tuning_fields(DEFAULT_TUNING), "median_s",
                                               "load_gbps", "load_vs_pinned")}
        log(f"best: {result['best']}")
    path = a.out / f"refill-{a.backend}.json"
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
