"""What a `criu restore` pays besides the pages: its kernel probe and its debug log. Not run
by `make test`.

    python3 bench/criu_fixed_costs_bench.py [--gib 1] [--maps 4000] [--imports torch]
                                            [--runs 5] [--criu PATH] [--out DIR]

A Python process (importing IMPORTS, holding GIB of random bytes in MAPS separate
mappings, as an engine's interpreter has thousands) is dumped once, then restored RUNS
times each way, the ways taken in turn:
- criu-restore: `-v2` (Pitstop's default, snapshots.restore_log_level), CRIU's kernel probe
  kept in /run/criu.kdat as on a host whose /run is a tmpfs (systemd's);
- criu-restore-debug-log: `-v4`, a line per mapping and file;
- criu-restore-no-kdat-cache: `-v2`, /run/criu.kdat removed first, as on a host whose /run
  is not a tmpfs (CRIU keeps it only on one, criu/kerndat.c);
- criu-restore-debug-log-no-kdat-cache: both, what restores cost before 2026-12-07 on such
  a host.
The restores run in a private mount namespace with a tmpfs on /run (this script re-runs
itself under `unshare`), so the host's /run is left alone; the process writes nowhere (a
file it inherited from outside that namespace, such as a log its caller redirected to,
is on a mount CRIU cannot find there, and the dump fails). `runs_s` is `criu restore`'s own
time, `log_lines` the lines of its log. Run as root, with CRIU >= 4.2 (`make criu`). Rows go
to OUT/<date>-criu-fixed-costs-<machine>.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_recovery_bench import REPO
from lazy_restore_bench import restore_row, wait_file, wait_gone, write_rows

# argv: GIB MAPS OUT IMPORTS...
BALLAST = """
import importlib, mmap, os, sys, time
gib, maps, out = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for name in sys.argv[4:]:
    importlib.import_module(name)
size = max(4096, int(gib * 2**30) // maps // 4096 * 4096)
held = []
for _ in range(maps):
    m = mmap.mmap(-1, size)
    m.write(os.urandom(size))
    held.append(m)
with open(out + ".pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""

# (path, CRIU's -v, whether /run/criu.kdat is kept between restores)
WAYS = (
    ("criu-restore", 2, True),
    ("criu-restore-debug-log", 4, True),
    ("criu-restore-no-kdat-cache", 2, False),
    ("criu-restore-debug-log-no-kdat-cache", 4, False),
)
KDAT = Path("/run/criu.kdat")
INSIDE = "PITSTOP_BENCH_PRIVATE_RUN"


def restore_once(criu: str, images: Path, pid: int, verbosity: int, keep_kdat: bool) -> dict:
    if not keep_kdat:
        KDAT.unlink(missing_ok=True)
    log = images / f"restore-v{verbosity}.log"
    t0 = time.monotonic()
    r = subprocess.run([criu, "restore", "-D", str(images), "--shell-job", "-d",
                        f"-v{verbosity}", "-o", log.name], stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"criu restore failed: see {log}")
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    return {"restore_s": took, "log_lines": sum(1 for _ in log.open(errors="replace"))}


def bench(a: argparse.Namespace) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run"], check=True)
    with tempfile.TemporaryDirectory(prefix="criu-costs-") as tmp:
        work = Path(tmp)
        images, out = work / "images", work / "ballast"
        images.mkdir()
        ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(a.gib), str(a.maps),
                                    str(out), *a.imports], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        pid = int(wait_file(Path(f"{out}.pid"), 600))
        if subprocess.run([a.criu, "dump", "-t", str(pid), "-D", str(images), "--shell-job",
                           "-o", "dump.log"]).returncode != 0:
            ballast.kill()
            tail = (images / "dump.log").read_text(errors="replace").splitlines()[-15:]
            raise SystemExit("criu dump failed:\n" + "\n".join(tail))
        ballast.wait(30)  # the dump killed it; reaped, its PID is free for the restores
        image_bytes = sum(p.stat().st_size for p in images.glob("pages-*.img"))
        runs: dict[str, list[dict]] = {path: [] for path, _, _ in WAYS}
        restore_once(a.criu, images, pid, 2, True)  # the image in the page cache, kdat saved
        for _ in range(a.runs):
            for path, verbosity, keep in WAYS:
                runs[path].append(restore_once(a.criu, images, pid, verbosity, keep))
    rows = [restore_row(path, runs[path], a.gib, verbosity=v, kdat_cache=keep,
                        log_lines=runs[path][-1]["log_lines"], maps=a.maps,
                        imports=a.imports, image_bytes=image_bytes)
            for path, v, keep in WAYS]
    written = write_rows(a.out, "criu-fixed-costs", rows)
    for r in rows:
        print(f"{r['path']}: {r['median_s']} s ({r['runs_s']}), {r['log_lines']} log lines")
    print(f"wrote {written}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--maps", type=int, default=4000)
    ap.add_argument("--imports", nargs="*", default=[])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--criu", default=str(REPO / ".cache" / "criu" / "bin" / "criu"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args()
    if os.environ.get(INSIDE):
        bench(a)
        return
    # A private mount namespace: the tmpfs on /run is this run's alone.
    env = {**os.environ, INSIDE: "1"}
    os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private", sys.executable,
                           *sys.argv], env)


if __name__ == "__main__":
    main()
