"""The front's own CPU per streamed token and per request, with the engine's cost out of it.

    python bench/front_cpu.py [--seconds 5] [--rounds 3] [--compare OTHER_CHECKOUT] [--floor]
                              [--json OUT.json]

front_bench.py measures the front beside a CPU-bound engine on the same cores, where the
front's CPU time per token swings with the contention (108-160 us on the 2-core VM). Here a
stand-in engine (an aiohttp server that streams one-token events like the reference
engine's, one write each, 2 ms apart, and costs next to nothing) serves the same loads, and
the front process's user and system CPU time is divided by the tokens or requests it
forwarded: a figure that compares two versions of the front. --compare runs the front of
another checkout (its `agent/`, e.g. `git worktree add /tmp/old main`) beside this one,
alternating; --floor adds a byte pump (TCP to Unix socket, no HTTP at all): the cost of the
extra process hop alone, which no proxy in Python gets under. --json writes each round's
figure too (a `rows` list, one row per load and front), since one round's noise on a shared
machine is larger than most differences between two versions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from front_bench import drive, loads  # noqa: E402

PROMPT = [0, 53, 84, 381, 504, 293, 265, 539]


# --- the stand-in engine (its own process) -------------------------------------------------
def _fake_engine(sock: str, gap: float) -> None:
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "created": 0, "owned_by": "pitstop"}]})

    async def generate(r: web.Request) -> web.StreamResponse:
        body = await r.json()
        chat, n, ids = r.path.endswith("chat/completions"), body.get("max_tokens", 16), \
            body.get("return_token_ids")
        env = {"id": "cmpl-829a312c495947a185477a788a7a6c3e",
               "object": "chat.completion.chunk" if chat else "text_completion",
               "created": int(time.time()), "model": "tiny"}
        if not body.get("stream"):
            await asyncio.sleep(gap * n)
            return web.json_response({**env, "object": "text_completion", "choices": [
                {"index": 0, "text": " own" * n, "logprobs": None, "finish_reason": "length",
                 "stop_reason": None}], "usage": {"prompt_tokens": 8, "completion_tokens": n,
                                                  "total_tokens": 8 + n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        for i in range(n):
            fin = "length" if i == n - 1 else None
            c: dict = ({"index": 0, "delta": {"content": " own"}} if chat else
                       {"index": 0, "text": " own"})
            c.update(logprobs=None, finish_reason=fin, stop_reason=None)
            obj = {**env, "choices": [c]}
            if ids:
                c["token_ids"] = [974]
                if i == 0:
                    (obj if chat else c)["prompt_token_ids"] = PROMPT
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    web.run_app(app, path=sock, access_log=None, print=None)


# --- the floor: a byte pump ------------------------------------------------------------------
class _Up(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class _Down(asyncio.Protocol):
    def __init__(self, sock: str) -> None:
        self.sock = sock

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t, self.early, self.up = transport, [], None
        self.opening = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        self.up, _ = await loop.create_unix_connection(lambda: _Up(self.t), self.sock)
        for b in self.early:
            self.up.write(b)

    def data_received(self, data: bytes) -> None:
        (self.up.write if self.up else self.early.append)(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up:
            self.up.close()


def _pump(sock: str) -> None:
    async def serve() -> None:
        srv = await asyncio.get_running_loop().create_server(lambda: _Down(sock), "127.0.0.1", 0)
        print(srv.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


# --- the measurement ---------------------------------------------------------------------------
def _cpu(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _start(cmd: list[str], root: Path = ROOT) -> tuple[subprocess.Popen, int]:
    # The checkout's own agent/, whatever is installed.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _front_cmd(root: Path, sock: Path) -> list[str]:
    return [sys.executable, str(root / "bench/front_bench.py"), "_front", "--sock", str(sock)]


async def measure(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="pitstop-fcpu-"))
    sock = work / "engine.sock"
    engine = subprocess.Popen([sys.executable, __file__, "_engine", str(sock), str(args.gap)])
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        while not sock.exists():
            await asyncio.sleep(0.05)
        procs["this"] = _start(_front_cmd(ROOT, sock))
        if args.compare:
            other = args.compare.resolve()
            procs["compare"] = _start(_front_cmd(other, sock), other)
        if args.floor:
            procs["byte pump"] = _start([sys.executable, __file__, "_pump", str(sock)])
        chosen = [x for x in loads() if x.name.startswith(("models", "streaming"))]
        totals: dict[tuple[str, str], list[float]] = {}
        rounds: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for load in chosen:
                for name, (proc, port) in procs.items():
                    await drive("front", sock, port, load, 0.3, proc.pid)  # warm
                    u0, s0 = _cpu(proc.pid)
                    res = await drive("front", sock, port, load, args.seconds, proc.pid)
                    u1, s1 = _cpu(proc.pid)
                    t = totals.setdefault((load.name, name), [0.0, 0.0, 0, 0])
                    t[0] += u1 - u0
                    t[1] += s1 - s0
                    t[2] += res.tokens or len(res.latencies)
                    t[3] += res.errors
                    n = res.tokens or len(res.latencies)
                    rounds.setdefault((load.name, name), []).append(
                        1e6 * (u1 - u0 + s1 - s0) / n if n else float("nan"))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        _report(args, totals, rounds)
    finally:
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        engine.terminate()
        engine.wait()
        for p in work.iterdir():
            p.unlink()
        work.rmdir()


def _report(args: argparse.Namespace, totals: dict[tuple[str, str], list[float]],
            rounds: dict[tuple[str, str], list[float]]) -> None:
    print("| load | front | user us | system us | total us | per | errors |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: |")
    for (load_name, name), (u, s, n, err) in totals.items():
        per = "token" if "stream" in load_name else "request"
        print(f"| {load_name} | {name} | {1e6 * u / n:.1f} | {1e6 * s / n:.1f} | "
              f"{1e6 * (u + s) / n:.1f} | {per} | {err} |")
    print("\nper round, total us (median; min-max):")
    for (load_name, name), runs in rounds.items():
        print(f"  {load_name} | {name}: {statistics.median(runs):.1f} "
              f"({min(runs):.1f}-{max(runs):.1f}) {' '.join(f'{x:.1f}' for x in runs)}")
    if args.json:
        _write_json(args, totals, rounds)


def _write_json(args: argparse.Namespace, totals: dict[tuple[str, str], list[float]],
                rounds: dict[tuple[str, str], list[float]]) -> None:
    """The result rows: one per load and front, its runs the rounds' figures (in us)."""
    rows = []
    for (load_name, name), runs in rounds.items():
        u, s, n, err = totals[(load_name, name)]
        per = "token" if "stream" in load_name else "request"
        rows.append({
            "engine": "front", "path": load_name, "gib": 0, "front": name,
            "checkout": str(args.compare.resolve() if name == "compare" else ROOT),
            "unit": f"us of front CPU (user+system) per {per}",
            "runs_s": [round(x, 2) for x in runs], "median_s": round(statistics.median(runs), 2),
            "pooled": round(1e6 * (u + s) / n, 2), "user": round(1e6 * u / n, 2),
            "system": round(1e6 * s / n, 2), "errors": int(err), "machine": "cpu-vm",
            "command": " ".join(["python", *sys.argv])})
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_average": os.getloadavg()},
           "seconds": args.seconds, "rounds": args.rounds, "gap_s": args.gap, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")


def main() -> int:
    if sys.argv[1:2] == ["_engine"]:
        _fake_engine(sys.argv[2], float(sys.argv[3]))
        return 0
    if sys.argv[1:2] == ["_pump"]:
        _pump(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap", type=float, default=0.002, help="seconds between engine events")
    p.add_argument("--compare", type=Path, help="another checkout whose front runs beside")
    p.add_argument("--floor", action="store_true", help="also a byte pump: the hop's floor")
    p.add_argument("--json", type=Path, help="also write the rows, each round's figure in them")
    asyncio.run(measure(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
