"""CRIU's restore against its lazy restore, on a plain process: is reading the image before
the resume what the hybrid restore waits for? Not run by `make test`.

    python3 bench/lazy_restore_bench.py [--gib 1] [--runs 3] [--criu PATH] [--out DIR]

A Python process holds GIB of random bytes (private anonymous memory, as most of a vLLM
hybrid image is). It is dumped once, then restored RUNS times each way:
- criu-restore: `criu restore -d`, which writes every page into place before it returns;
- criu-restore-lazy: `criu lazy-pages` serving the pages by userfaultfd and `criu restore -d
  --lazy-pages`, which returns once the tree is rebuilt; the daemon then hands pages over as
  they are touched and sends the rest in the background.
After each restore the process is asked (SIGUSR1) to hash all its bytes; the row's
`runs_s` is the restore's own time, `all_pages_s` the time from the restore's start to that
hash's end (every page in place and read once), `hash_s` the hash alone. Equal hashes are
checked against the first run. Run as root, with CRIU >= 4.2 (`make criu`) and
`criu check --feature uffd-noncoop` passing. Rows go to OUT/<date>-lazy-restore-<machine>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_recovery_bench import REPO, machine

BALLAST = """
import hashlib, os, signal, sys, time
out = sys.argv[2]
b = bytearray(os.urandom(int(float(sys.argv[1]) * 2**30)))
def touch(*_):
    t = time.monotonic()
    h = hashlib.sha1(b).hexdigest()
    with open(out + ".tmp", "w") as f:
        f.write(f"{time.monotonic() - t} {h}")
    os.rename(out + ".tmp", out)
signal.signal(signal.SIGUSR1, touch)
with open(out + ".pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def wait_exists(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.002)


def wait_file(path: Path, timeout: float = 120) -> str:
    wait_exists(path, timeout)
    return path.read_text()


def wait_gone(pid: int, timeout: float = 30) -> None:
    """Until the PID is free again (a restore needs it), the killed process reaped."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} still there {timeout} s after SIGKILL")
        time.sleep(0.01)


def restore_row(path: str, runs: list[dict], gib: float, **extra: object) -> dict:
    """One result row of a plain CRIU restore bench: `runs` each carry `restore_s`; the
    machine and the command (this script's own invocation) are filled in."""
    where, host = machine()
    return {"engine": "ballast", "path": path, "gib": gib,
            "runs_s": [round(r["restore_s"], 3) for r in runs],
            "median_s": round(statistics.median(r["restore_s"] for r in runs), 3),
            **extra, "machine": where, "host": host,
            "command": " ".join(["python3", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])}


def write_rows(out_dir: Path, name: str, rows: list[dict]) -> Path:
    """OUT_DIR/<date>-NAME-<machine>.json with `rows` (the machine's name without spaces)."""
    where = rows[0]["machine"].replace(" ", "-") if rows else "unknown"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today()}-{name}-{where}.json"
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return path


def restore_once(criu: str, images: Path, done: Path, pid: int, lazy: bool) -> dict:
    done.unlink(missing_ok=True)
    daemon = None
    tag = "lazy" if lazy else "plain"
    if lazy:
        sock = images / "lazy-pages.socket"
        sock.unlink(missing_ok=True)
        daemon = subprocess.Popen([criu, "lazy-pages", "-D", str(images), "-o", "lazy.log"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        wait_exists(sock, 30)
    t0 = time.monotonic()
    try:
        subprocess.run([criu, "restore", "-D", str(images), "--shell-job", "-d",
                        "-o", f"restore-{tag}.log", *(["--lazy-pages"] if lazy else [])],
                       check=True, stdin=subprocess.DEVNULL)
    except subprocess.CalledProcessError:
        if daemon is not None:
            daemon.kill()
        raise SystemExit(f"criu restore failed: see {images}/restore-{tag}.log") from None
    restored = time.monotonic() - t0
    os.kill(pid, signal.SIGUSR1)
    hash_s, digest = wait_file(done).split()
    all_pages = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    if daemon is not None:
        daemon.wait(60)
    return {"restore_s": restored, "all_pages_s": all_pages, "hash_s": float(hash_s),
            "digest": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--criu", default=str(REPO / ".cache" / "criu" / "bin" / "criu"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lazy-bench-") as tmp:
        work = Path(tmp)
        images, done = work / "images", work / "touched"
        images.mkdir()
        ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(a.gib), str(done)],
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        pid = int(wait_file(Path(f"{done}.pid")))
        subprocess.run([a.criu, "dump", "-t", str(pid), "-D", str(images), "--shell-job",
                        "-o", "dump.log"], check=True)
        ballast.wait(30)  # the dump killed it; reaped, its PID is free for the restores
        image_bytes = sum(p.stat().st_size for p in images.glob("pages-*.img"))
        runs: dict[str, list[dict]] = {"criu-restore": [], "criu-restore-lazy": []}
        for _ in range(a.runs):
            for path, lazy in (("criu-restore", False), ("criu-restore-lazy", True)):
                runs[path].append(restore_once(a.criu, images, done, pid, lazy))
    digests = {r["digest"] for rs in runs.values() for r in rs}
    if len(digests) != 1:
        raise SystemExit(f"the restored bytes differ between runs: {sorted(digests)}")
    rows = [restore_row(path, rs, a.gib,
                        all_pages_s=[round(r["all_pages_s"], 3) for r in rs],
                        hash_s=[round(r["hash_s"], 3) for r in rs], image_bytes=image_bytes)
            for path, rs in runs.items()]
    out = write_rows(a.out, "lazy-restore", rows)
    for r in rows:
        print(f"{r['path']}: restore {r['runs_s']} s, every page read by {r['all_pages_s']} s")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
