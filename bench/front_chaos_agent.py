"""Chaos through the real agent: `pitstop run`, its engine SIGKILLed every N seconds.

    python bench/front_chaos_agent.py --model DIR [--seconds 180] [--kill-every 20]

Unlike front_bench.py's chaos run (a small watcher plays the supervisor), here the agent's
own supervisor notices each crash, restarts the engine (cold start, or a restore when
snapshots are configured) and reopens the gate; the front holds and resumes. Appends a
Markdown section to bench/results/<date>-front-cpu.md (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from front_bench import MODEL_NAME, ROOT, Load, Result, loads, one  # noqa: E402


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


async def _wait(pred, status_path: Path, proc: subprocess.Popen, what: str,
                timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _status(status_path)
        if st and pred(st):
            return st
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited ({proc.returncode}) waiting for {what}")
        await asyncio.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}: {_status(status_path)}")


async def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="pitstop-chaos-"))
    cfg = {
        "engine": {"kind": "reference", "model": str(args.model), "device": "cpu",
                   "served_model_name": MODEL_NAME, "args": ["--kv-slots", "8"]},
        "paths": {"state_dir": str(work / "state")},
        "front": {"host": "127.0.0.1", "port": 0, "max_resumes": 5},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_s": 0.5, "timeout_s": 1.0},
        "restart": {"backoff_initial_s": 0.0, "backoff_max_s": 1.0,
                    "crash_loop_limit": 1000},
        "snapshots": {"enabled": args.snapshots},
    }
    (work / "pitstop.yaml").write_text(yaml.safe_dump(cfg))
    status_path = work / "state" / "run" / "status.json"
    log = open(work / "agent.log", "ab")  # noqa: SIM115 - closed below
    agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config",
                              str(work / "pitstop.yaml")], cwd=ROOT, stdout=log, stderr=log)
    try:
        st = await _wait(lambda s: s.get("state") == "ready" and s.get("front"), status_path,
                         agent, "the agent ready")
        base = f"http://{st['front']}"
        mix = [x for x in loads() if x.name.startswith("streaming")]
        mix.append(Load("whole", "POST", "/v1/completions",
                        {**mix[0].body, "stream": False}, 1))  # type: ignore[dict-item]
        refs: dict[str, str] = {}
        async with aiohttp.ClientSession() as s:
            for load in mix:
                body = {**load.body, "stream": False}  # type: ignore[dict-item]
                async with s.post(base + load.path, json=body) as r:
                    c = (await r.json())["choices"][0]
                refs[load.name] = c["text"] if "text" in c else c["message"]["content"]
        res, sent, kills, restarts = Result(), [0], 0, []
        end = time.perf_counter() + args.seconds

        async def client(s: aiohttp.ClientSession, i: int) -> None:
            while time.perf_counter() < end:
                load = mix[(i + sent[0]) % len(mix)]
                sent[0] += 1
                await one(s, base, load, res, refs[load.name])

        async def killer() -> None:
            nonlocal kills
            while time.perf_counter() + args.kill_every < end:
                await asyncio.sleep(args.kill_every)
                pid = _status(status_path).get("engine_pid")
                if not pid:
                    continue
                t0 = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                kills += 1
                await _wait(lambda s, p=pid: s.get("state") == "ready"
                            and s.get("engine_pid") not in (None, p), status_path, agent,
                            "the engine back")
                restarts.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(killer(), *(client(s, i) for i in range(args.clients)))
        seconds = time.perf_counter() - t0
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://{_status(status_path)['metrics']}/metrics") as r:
            metrics = [line for line in (await r.text()).splitlines()
                       if line.startswith(("pitstop_front_resumed", "pitstop_front_failed",
                                           "pitstop_recoveries_total"))
                       and "_created" not in line]
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    now = datetime.datetime.now(datetime.UTC)
    lines = [
        "", f"## Chaos through the real agent ({now:%Y-%m-%d %H:%M} UTC)", "",
        f"- command: `python bench/front_chaos_agent.py {' '.join(sys.argv[1:])}`",
        f"- `pitstop run` with the reference engine on CPU "
        f"({'snapshots on' if args.snapshots else 'cold starts'}), {args.clients} "
        f"clients in a loop over streaming completions, streaming chat and non-streaming "
        f"completions (max_tokens=64, greedy, compared with the uninterrupted answer); the "
        f"engine's PID SIGKILLed every {args.kill_every:g} s for {seconds:.0f} s; load "
        f"average {os.getloadavg()[0]:.1f} at the end", "",
        "| kills | requests sent | completed and correct | failed | wrong text | worst stall s "
        "| p50 s | p99 s | engine back after (s, each kill) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {kills} | {sent[0]} | {len(res.latencies) - res.wrong} | {res.errors} | "
        f"{res.wrong} | {res.worst_gap:.2f} | {res.pct(res.latencies, 0.5):.2f} | "
        f"{res.pct(res.latencies, 0.99):.2f} | "
        f"{', '.join(f'{x:.1f}' for x in restarts)} |", "",
        "Agent metrics afterwards:", "", "```", *metrics, "```",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/pitstop/tiny-llama")
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--snapshots", action="store_true",
                   help="let the agent snapshot and restore (needs CRIU: `make criu`)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    text = asyncio.run(run(args))
    out = args.out or ROOT / "bench" / "results" / (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}-front-cpu.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(text)
    print(text)
    print(f"appended to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
