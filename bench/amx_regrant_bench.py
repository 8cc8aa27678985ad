"""What asking for the AMX permission again costs a restore: Snapshotter.restore of a
two-process tree (tests/workloads/tiles.c, a server blocked in accept() and a child
spinning in user space) with the re-grant off and on, and the re-grant stage alone.

    python bench/amx_regrant_bench.py --runs 7      (root, CRIU from `make criu`, gcc)

Writes bench/results/<date>-amx-regrant-<tag>.json (tag: the host name unless --tag)
with a `rows` list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import proc  # noqa: E402
from agent.checkpoint.backend import CreateRequest, take  # noqa: E402
from agent.checkpoint.criu import CriuBackend  # noqa: E402
from agent.checkpoint.criu_locate import locate  # noqa: E402
from agent.checkpoint.snapshotter import Snapshotter  # noqa: E402
from agent.checkpoint.xcomp import Regrant, cpu_has_amx  # noqa: E402
from agent.identity import collect  # noqa: E402
from agent.store import Canary, SnapshotStore  # noqa: E402

SOURCE = REPO / "tests" / "workloads" / "tiles.c"
ENGINE = "tiles.c (server + spinner)"


def ask(sock: Path, what: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(what.encode() + b"\n")
        return s.recv(128).decode().strip()


def reap(*pids: int) -> None:
    """Kill the tree and reap it all: the next restore needs its PIDs free."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        if time.monotonic() > deadline:
            raise SystemExit(f"PIDs {pids} were not reaped within 30 s")
        proc.reap_orphans()
        time.sleep(0.005)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")  # fmt: skip
    amx = "AMX" if cpu_has_amx() else "no AMX"
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {amx}, {platform.release()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default=platform.node(), help="the result file's name ends in it")
    args = p.parse_args()
    proc.become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="amx-bench-"))
    binary = work / "tiles"
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(SOURCE)], check=True)
    criu = CriuBackend(locate())
    snap = Snapshotter(SnapshotStore(work / "snaps"), criu, None, log_dir=work / "logs")
    sock = work / "t.sock"
    with proc.spawn_lock():
        t = subprocess.Popen([str(binary), str(sock), "--spinner"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
        proc.own(t.pid)
    assert t.stdout is not None and t.stdout.readline().startswith(b"ready")
    child = int(ask(sock, "pids").split()[2])
    canary = Canary(prompt="pids", max_tokens=1, text="", token_ids=())
    info = take(snap.store, snap, CreateRequest("full", pid=t.pid, canary=canary),
                collect(engine_kind="tiles", engine_version="1", criu=criu.version))
    t.wait()
    proc.disown(t.pid)
    reap(child, t.pid)
    series: dict[str, list[float]] = {"restore, re-grant off": [], "restore, re-grant on": [],
                                      "re-grant stage": []}  # fmt: skip
    for _ in range(args.runs):
        for regrant, name in ((Regrant.OFF, "restore, re-grant off"),
                              (Regrant.ALWAYS, "restore, re-grant on")):  # fmt: skip
            snap.regrant = regrant
            t0 = time.monotonic()
            r = snap.restore(info.manifest)
            series[name].append(time.monotonic() - t0)
            if regrant is Regrant.ALWAYS:
                series["re-grant stage"].append(r.timings["amx_regrant"])
            assert ask(sock, "pids").split()[1] == str(r.pid)
            for f in set(r.outputs.values()):
                f.close()
            reap(r.pid, child)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    where = machine()
    rows = [{"engine": ENGINE, "path": name, "gib": round(info.image_bytes / 2**30, 4),
             "runs_s": [round(x, 5) for x in runs], "median_s": round(statistics.median(runs), 5),
             "machine": where, "command": command} for name, runs in series.items()]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    out = args.out / f"{day}-amx-regrant-{args.tag}.json"
    out.write_text(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"),
                               "command": command, "rows": rows}, indent=1) + "\n")  # fmt: skip
    for row in rows:
        print(f"{row['path']:<24} median {row['median_s'] * 1000:8.2f} ms  {row['runs_s']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
