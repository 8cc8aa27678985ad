"""CRIU's restore of a two-process tree shaped like vLLM's, with and without Pitstop's small
root above it (engine.small_root): how long the root's wait for the rest costs. Not run by
`make test`.

    python3 bench/tree_root_bench.py [--api-gib 0.66] [--core-gib 1.2] [--runs 3]
                                     [--criu PATH] [--out DIR]

An "API server" (a Python process holding API_GIB of random bytes) starts an "engine core"
(a second Python process, exec'd, holding CORE_GIB): the shares of a vLLM hybrid image on an
H100 (0.66 and 1.19 GB). Two trees, each dumped once, then restored RUNS times:
- engine-root: the API server is the root of its tree (engine.small_root false);
- small-root: the API server runs under `agent/deathsig.py --root`, as the agent starts vLLM.
CRIU lets a tree's root read its memory only after every other process finished restoring
(`restore_wait_other_tasks`, criu/cr-restore.c), so the first tree reads the two in turn,
the second at once. After each restore both processes hash their bytes (SIGUSR1); the hashes
must equal the first run's. `runs_s` is `criu restore`'s own time. Run as root, with CRIU >=
4.2 (`make criu`). Rows go to OUT/<date>-tree-root-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_recovery_bench import REPO
from lazy_restore_bench import restore_row, wait_file, wait_gone, write_rows

from agent.proc import with_deathsig

# argv: GIB OUT [CHILD_GIB]: hold GIB, start the child (this same program) if CHILD_GIB.
BALLAST = """
import hashlib, os, signal, subprocess, sys, time
gib, out = float(sys.argv[1]), sys.argv[2]
b = bytearray(os.urandom(int(gib * 2**30)))
def touch(*_):
    h = hashlib.sha1(b).hexdigest()
    with open(out + ".tmp", "w") as f:
        f.write(h)
    os.rename(out + ".tmp", out)
signal.signal(signal.SIGUSR1, touch)
if len(sys.argv) > 3:
    child = subprocess.Popen([sys.executable, sys.argv[0], sys.argv[3], out + ".core"],
                             stdin=subprocess.DEVNULL)
    while not os.path.exists(out + ".core.pid"):
        time.sleep(0.01)
with open(out + ".pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def dump_tree(criu: str, work: Path, layout: str, api_gib: float, core_gib: float
              ) -> tuple[Path, dict[str, int], int]:
    """Start the tree, dump it (which kills it); its image, its pids, its root."""
    images, out, program = work / layout, work / f"{layout}-touched", work / "ballast.py"
    images.mkdir()
    program.write_text(BALLAST)
    api = [sys.executable, str(program), str(api_gib), str(out), str(core_gib)]
    argv = with_deathsig(api, root=True) if layout == "small-root" else api
    root = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    pids = {"api": int(wait_file(Path(f"{out}.pid"))),
            "core": int(wait_file(Path(f"{out}.core.pid")))}
    subprocess.run([criu, "dump", "-t", str(root.pid), "-D", str(images), "--shell-job",
                    "-o", "dump.log"], check=True)
    root.wait(30)
    for pid in pids.values():
        wait_gone(pid)
    return images, pids, root.pid


def restore_once(criu: str, images: Path, out: Path, pids: dict[str, int], root: int) -> dict:
    touched = {role: Path(f"{out}{'.core' if role == 'core' else ''}") for role in pids}
    for p in touched.values():
        p.unlink(missing_ok=True)
    t0 = time.monotonic()
    # --restore-sibling: the restored root is our child, so its death signal (the small
    # root's, armed on us) does not fire when CRIU exits.
    done = subprocess.run([criu, "restore", "-D", str(images), "--shell-job", "-d",
                           "--restore-sibling", "-o", "restore.log"], stdin=subprocess.DEVNULL)
    restored = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"criu restore failed: see {images}/restore.log")
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    digests = {role: wait_file(p) for role, p in touched.items()}
    os.kill(root, signal.SIGKILL)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    os.waitpid(root, 0)
    for pid in pids.values():
        wait_gone(pid)
    return {"restore_s": restored, "digests": digests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api-gib", type=float, default=0.66)
    ap.add_argument("--core-gib", type=float, default=1.2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--criu", default=str(REPO / ".cache" / "criu" / "bin" / "criu"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tree-root-bench-") as tmp:
        work = Path(tmp)
        for layout in ("engine-root", "small-root"):
            images, pids, root = dump_tree(a.criu, work, layout, a.api_gib, a.core_gib)
            out = work / f"{layout}-touched"
            runs[layout] = [restore_once(a.criu, images, out, pids, root)
                            for _ in range(a.runs)]
            if len({json.dumps(r["digests"], sort_keys=True) for r in runs[layout]}) != 1:
                raise SystemExit(f"{layout}: the restored bytes differ between runs")
    rows = [restore_row(layout, rs, round(a.api_gib + a.core_gib, 3), api_gib=a.api_gib,
                        core_gib=a.core_gib)
            for layout, rs in runs.items()]
    path = write_rows(a.out, "tree-root", rows)
    for r in rows:
        print(f"{r['path']}: criu restore {r['runs_s']} s (median {r['median_s']})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
