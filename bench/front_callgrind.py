"""The front's instructions per streamed token or request, counted by callgrind (no noise).

    python bench/front_callgrind.py CHECKOUT [--load streaming] [--seconds 6] [--gap 0.01]

front_cpu.py's CPU time swings by 10-20 % between rounds on a shared machine, more than most
changes to the front. Here the front of CHECKOUT (its `agent/`) runs under valgrind's
callgrind, counting only while one client streams through it from front_cpu.py's stand-in
engine; the user-space instructions it executed, divided by the tokens (or requests), repeat
within about 0.1 % (hash seed fixed, one client: one engine event a read). System time (the
socket calls, the same number for any version) is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from front_bench import drive, loads  # noqa: E402


def _instructions(out: Path) -> int:
    for line in out.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {out}")


async def measure(args: argparse.Namespace) -> None:
    root = args.checkout.resolve()
    work = Path(tempfile.mkdtemp(prefix="pitstop-fcg-"))
    sock, out = work / "engine.sock", work / "callgrind.out"
    engine = subprocess.Popen([sys.executable, str(ROOT / "bench/front_cpu.py"), "_engine",
                               str(sock), str(args.gap)])
    front = None
    try:
        while not sock.exists():
            await asyncio.sleep(0.05)
        front = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             sys.executable, str(root / "bench/front_bench.py"), "_front", "--sock", str(sock),
             "--poll", "1000"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=root,
            env={**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0"})
        assert front.stdout is not None
        port = int(front.stdout.readline())
        load = next(x for x in loads() if x.name.startswith(args.load))
        load = dataclasses.replace(load, concurrency=1)
        await drive("front", sock, port, load, 3, front.pid)  # warm, not counted
        subprocess.run(["callgrind_control", "-i", "on", str(front.pid)], check=True,
                       capture_output=True)
        res = await drive("front", sock, port, load, args.seconds, front.pid)
        subprocess.run(["callgrind_control", "-i", "off", str(front.pid)], check=True,
                       capture_output=True)
        front.send_signal(signal.SIGTERM)
        front.communicate(timeout=120)
        n = res.tokens or len(res.latencies)
        per = "token" if res.tokens else "request"
        print(f"{root} | {args.load}, 1 client | {_instructions(out) / n:.0f} instructions "
              f"per {per} | {n} {per}s, {res.errors} errors")
    finally:
        if front is not None and front.poll() is None:
            front.kill()
            front.wait()
        engine.terminate()
        engine.wait()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkout", type=Path, help="the checkout whose agent/ front to count")
    p.add_argument("--load", default="streaming completions",
                   help="a front_bench load by the start of its name (models, streaming chat)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--gap", type=float, default=0.01, help="seconds between engine events")
    asyncio.run(measure(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
