"""A thousand failures: the whole node under steady load while an injector keeps breaking it.

    python bench/soak.py [--failures 1000] [--seed 0] [--out bench/results/DATE-soak-cpu.json]
    python bench/soak.py --engine vllm --failures 30 --out bench/results/DATE-soak-vllm-cpu.json

Runs the real node (bench/chaos.py: holder on its cpu backend, `pitstop run` with the front,
the supervisor and the reference engine, snapshots on a tmpfs it mounts) under clients that
stream and ask for whole answers (aiohttp and the official `openai` client), and injects a
mixed schedule of failures one after the other until --failures have been caused. Every
answer is compared with the uninterrupted answer to the same prompt. The JSON result (rows
per recovery path plus the totals) is rewritten every --save-every injections, so a run cut
short still reports; the per-injection log goes to stderr.

--engine vllm runs real vLLM (CPU build, .venv-vllm) instead of the reference engine, without
a holder (chaos.VLLM_MIX: no holder kill, no weights rewrite; the engine core is killed on its
own), with kernel.io_uring_disabled=2 while it runs (the old value is put back after).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import (  # noqa: E402
    DEFAULT_MIX,
    ROOT,
    VLLM_MIX,
    Injector,
    Kind,
    Load,
    Node,
    injections_json,
    schedule,
    summary,
)


def progress(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def result(args: argparse.Namespace, inj: Injector, load: Load, node: Node,
           started: float, finished: bool) -> dict[str, Any]:
    s = summary(inj.done, load.tally, inj.books, max(0, node.holder_starts - 1), 0)
    machine = f"{platform.node()} ({os.cpu_count()} cpu, shared)" \
        if args.engine == "reference" else f"cpu-{os.cpu_count()}core"
    command = "python bench/soak.py " + " ".join(sys.argv[1:])
    by_path: dict[str, list[float]] = {}
    for i in inj.done:
        if i.path and i.recovery_s is not None:
            by_path.setdefault(i.path, []).append(i.recovery_s)
    rows = [{"engine": args.engine, "path": p, "gib": 0.0, "runs_s": v,
             "median_s": s["recoveries"][p]["p50_s"], "machine": machine,
             "command": command, **s["recoveries"][p]} for p, v in sorted(by_path.items())]
    return {"bench": "soak", "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "finished": finished, "seconds": round(time.monotonic() - started, 1),
            "engine": args.engine, "machine": machine, "command": command,
            "seed": args.seed,
            "rows": rows, **s, "injections": injections_json(inj.done)}


def write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="pitstop-soak-", dir=args.work))
    model = work / "model"
    if args.model:
        shutil.copytree(args.model, model)
    else:
        subprocess.run([sys.executable, "-m", "agent", "make-model", str(model)], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
    node = Node(work, model, store_mib=args.store_mib, engine=args.engine)
    base = VLLM_MIX if args.engine == "vllm" else DEFAULT_MIX
    mix = base if not args.kinds else {
        Kind(k): base.get(Kind(k), 10) for k in args.kinds.split(",")}
    plan = schedule(args.failures, mix, args.seed)
    started = time.monotonic()
    # A SIGTERM (a run cut short) ends the soak through the finally below: partial results
    # are written and the node's processes stopped.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    node.start()
    inj = Injector(node, seed=args.seed)
    load: Load | None = None
    try:
        st = await node.wait_for(lambda s: s.get("state") == "ready"
                                 and "published" in s.get("reason", ""), "the first snapshot")
        load = Load(f"http://{st['front']}")
        await load.references()
        load.start()
        progress(f"node up in {work}; {len(plan)} injections to go")
        for n, kind in enumerate(plan, 1):
            if args.max_minutes and time.monotonic() - started > args.max_minutes * 60:
                progress(f"--max-minutes {args.max_minutes:g} reached after {n - 1} injections")
                break
            await asyncio.sleep(args.pause)
            try:
                i = await inj.inject(kind)
            except Exception as e:  # noqa: BLE001 - recorded; the soak goes on if the node does
                progress(f"{n} {kind}: FAILED {type(e).__name__}: {e}")
                inj.failed(kind, f"{type(e).__name__}: {e}")
                await node.ready()
                continue
            t = load.tally
            progress(f"{n} {kind}: {i.seconds:.2f}s path={i.path or '-'} "
                     f"rec={i.recovery_s} sent={t.sent} failed={t.failed} wrong={t.wrong} "
                     f"lost={len(inj.books.lost)} bad={len(inj.books.bad_restored)} {i.note}")
            if n % args.save_every == 0:
                write(args.out, result(args, inj, load, node, started, False))
        await asyncio.sleep(args.pause)
        inj.final_audit()
        await load.stop()
    finally:
        if load is not None:
            write(args.out, result(args, inj, load, node, started, len(inj.done) == len(plan)))
        node.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            progress(f"kept {work}")
    return result(args, inj, load, node, started, True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--failures", type=int, default=1000)
    ap.add_argument("--engine", choices=("reference", "vllm"), default="reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", help="comma-separated kinds (default: the whole mix)")
    ap.add_argument("--model", type=Path, help="a model directory to copy (default: make one)")
    ap.add_argument("--store-mib", type=int, default=None,
                    help="the snapshot tmpfs size (default 1024; 9216 for vllm: 3.6 GB images)")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds of load between failures")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="inject no more once this much wall time has passed (0: no bound)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                    f"{datetime.date.today():%Y-%m-%d}-soak-cpu.json")
    args = ap.parse_args()
    if args.store_mib is None:
        args.store_mib = 9216 if args.engine == "vllm" else 1024
    if os.geteuid() != 0:
        print("bench/soak.py mounts a tmpfs for the snapshot store: run it as root",
              file=sys.stderr)
        return 2
    io_uring = Path("/proc/sys/kernel/io_uring_disabled")
    before = io_uring.read_text().strip() if args.engine == "vllm" else None
    if before is not None:
        io_uring.write_text("2")  # as `pitstop install-units` sets it on a node
    try:
        r = asyncio.run(soak(args))
    finally:
        if before is not None:
            io_uring.write_text(before)
    print(json.dumps({k: v for k, v in r.items() if k not in ("injections", "rows")}, indent=1))
    return 0 if not (r["requests_failed"] or r["requests_wrong"] or r["good_snapshots_lost"]
                     or r["bad_snapshots_restored"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
