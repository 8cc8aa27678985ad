"""The holder's refill load alone: a real `pitstop holder` loads N GiB of safetensors files
from the page cache into its regions, against the host's own copy rate measured in the
same run.

cpu backend: into memfds; the reference is one thread reading the same files into a
buffer. cuda backend: into device memory through pinned buffers and async copies; the
reference is cuMemcpyHtoD from pinned host memory (what an ideal refill would reach).
Not part of `make test`. From the repository root:

    python3 bench/refill_bench.py OUT --backend cpu --gib 1 --runs 3
    python3 bench/refill_bench.py OUT --backend cuda --gib 8,32 --runs 3 --files /dev/shm/rb

The files are written once (random bytes, 2 GiB shards like a real checkpoint's) and read
once before timing, so every run reads from the page cache. The plan's sha256s are
placeholders: a refill checks the files' stat keys, it does not hash them. Writes
OUT/refill-<backend>.json whose `rows` hold one line per size.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.holder.client import HolderClient  # noqa: E402
from agent.holder.weightplan import build_plan, write_plan  # noqa: E402
from agent.weights import FileDigest, manifest_digest  # noqa: E402

SHARD = 2 << 30
BLOCK = 64 << 20


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_files(d: Path, nbytes: int) -> list[Path]:
    """Shards of `nbytes` in all, each a safetensors file of one uint8 tensor."""
    d.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(BLOCK))
    out, left, i = [], nbytes, 0
    while left > 0:
        size = min(SHARD, left)
        path = d / f"model-{i:05d}.safetensors"
        header = json.dumps({"w": {"dtype": "U8", "shape": [size],
                                   "data_offsets": [0, size]}}).encode()
        header += b" " * (-len(header) % 8)
        if not path.exists() or path.stat().st_size != 8 + len(header) + size:
            with path.open("wb") as f:
                f.write(len(header).to_bytes(8, "little") + header)
                done = 0
                while done < size:
                    block[:8] = (i * SHARD + done).to_bytes(8, "little")  # no two blocks alike
                    n = min(BLOCK, size - done)
                    f.write(memoryview(block)[:n])
                    done += n
        out.append(path)
        left -= size
        i += 1
    for stale in sorted(d.glob("model-*.safetensors"))[len(out):]:
        stale.unlink()
    return out


def read_all(files: list[Path]) -> float:
    """One thread reading every file once: seconds (the cpu reference, and the warm-up)."""
    buf = bytearray(BLOCK)
    t0 = time.perf_counter()
    for p in files:
        with p.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def pinned_h2d_gbps(nbytes: int = 4 << 30, reps: int = 3) -> float:
    """cuMemcpyHtoD from one pinned buffer to device memory, best of `reps`, in GB/s."""
    from cuda.bindings import driver as cu

    def ck(r):  # noqa: ANN001, ANN202
        err, *v = r if isinstance(r, tuple) else (r,)
        if int(err) != 0:
            raise RuntimeError(f"{err}")
        return v[0] if v else None

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
    ck(cu.cuCtxSetCurrent(ctx))
    host = ck(cu.cuMemHostAlloc(nbytes, 0))
    devp = ck(cu.cuMemAlloc(nbytes))
    best = 0.0
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            ck(cu.cuMemcpyHtoD(devp, host, nbytes))
            ck(cu.cuCtxSynchronize())
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        ck(cu.cuMemFree(devp))
        ck(cu.cuMemFreeHost(host))
        ck(cu.cuDevicePrimaryCtxRelease(dev))
    return best


def verify_cuda(sock: Path, plan) -> int:  # noqa: ANN001 - a RefillPlan
    """Compare 1 MiB at the start, middle and end of every held region with its file: the
    bytes a refill put on the GPU are the file's. Returns the samples compared."""
    from cuda.bindings import driver as cu

    from agent.tenant.mapping_cuda import CudaSpace

    n = 0
    with HolderClient(sock, timeout=60) as c:
        for r in plan.regions:
            with c.attach(r.name) as g:
                space = CudaSpace(g.region.mapped_size, g.region.align, device=0)
                try:
                    space.map(0, g.fds, g.region.chunks)
                    for off in (0, r.size // 2, max(0, r.size - (1 << 20))):
                        k = min(1 << 20, r.size - off)
                        got = bytearray(k)
                        err, = cu.cuMemcpyDtoH(got, space.base + off, k)
                        assert int(err) == 0, err
                        with open(Path(plan.model) / r.file, "rb") as f:
                            f.seek(r.offset + off)
                            want = f.read(k)
                        if bytes(got) != want:
                            raise SystemExit(f"{r.name}: bytes at {off} differ from the file")
                        n += 1
                finally:
                    space.close()
    return n


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


class HolderProc:
    def __init__(self, backend: str, gpu: str, base: Path, logf: Path, threads: int | None):
        extra = ["--refill-threads", str(threads)] if threads else []
        self.p = subprocess.Popen([sys.executable, "-m", "agent", "holder", "--backend", backend,
                                   "--gpu", gpu, "--dir", str(base), "--no-refill", *extra],
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


def bench(backend: str, gib: float, runs: int, files_dir: Path, work: Path,
          threads: int | None) -> dict:
    nbytes = int(gib * (1 << 30))
    log(f"writing {gib} GiB of shards to {files_dir}")
    files = make_files(files_dir, nbytes)
    read_all(files)  # into the page cache
    digests = tuple(FileDigest(p.name, p.stat().st_size, "0" * 64) for p in files)
    digest = manifest_digest(digests)
    plan = build_plan(files_dir, digests, digest)
    gpu = gpu_uuid() if backend == "cuda" else "cpu"
    base = work / "holder"
    reference = (plan.bytes / read_all(files) / 1e9) if backend == "cpu" else pinned_h2d_gbps()
    log(f"reference rate {reference:.2f} GB/s "
        f"({'one-thread page-cache read' if backend == 'cpu' else 'pinned cuMemcpyHtoD'})")
    secs = []
    for i in range(runs):
        h = HolderProc(backend, gpu, base, work / "holder.log", threads)
        try:
            write_plan(h.sock.parent, plan)
            t0 = time.perf_counter()
            with HolderClient(h.sock, timeout=600) as c:
                done = c.refill(digest)
            wall = time.perf_counter() - t0
            log(f"run {i + 1}: {done.bytes / 1e9:.2f} GB in {done.seconds:.3f}s "
                f"({done.gbps:.2f} GB/s; {wall:.3f}s from the request to the answer)")
            secs.append(wall)
            if backend == "cuda" and i == 0:
                log(f"verified {verify_cuda(h.sock, plan)} samples against the files")
        finally:
            h.stop()
    median = statistics.median(secs)
    return {"engine": "holder", "path": "refill-load", "gib": gib, "runs_s": secs,
            "median_s": median, "machine": machine(backend),
            "command": " ".join(["python3", "bench/refill_bench.py", *sys.argv[1:]]),
            "backend": backend, "bytes": plan.bytes, "gbps": plan.bytes / median / 1e9,
            "reference_gbps": reference,
            "reference": "one-thread page-cache read" if backend == "cpu"
            else "pinned cuMemcpyHtoD, best of 3 x 4 GiB",
            "fraction_of_reference": plan.bytes / median / 1e9 / reference,
            "threads": threads or "default"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gib", default="1")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, help="--refill-threads of the holder")
    ap.add_argument("--files", type=Path, default=Path("/dev/shm/pitstop-refill-bench"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    work.mkdir(exist_ok=True)
    rows = [bench(a.backend, float(g), a.runs, a.files, work, a.threads)
            for g in a.gib.split(",")]
    path = a.out / f"refill-{a.backend}.json"
    path.write_text(json.dumps({"rows": rows}, indent=1))
    log(f"wrote {path}")
    for r in rows:
        log(f"{r['gib']} GiB: median {r['median_s']:.3f}s, {r['gbps']:.2f} GB/s, "
            f"{100 * r['fraction_of_reference']:.0f}% of {r['reference_gbps']:.2f} GB/s")


if __name__ == "__main__":
    main()
