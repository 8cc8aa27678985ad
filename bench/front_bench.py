"""The front's cost and its crash-hiding, measured: front vs direct, and a chaos run.

    python bench/front_bench.py --model DIR [--seconds 15] [--rounds 2] [--chaos 180]

Starts the reference engine on a Unix socket and the front in a process of its own (with a
small watcher standing in for the supervisor: it closes the gate when the engine stops
answering and opens it for each new engine), then drives the same loads straight at the
engine's socket and through the front's TCP port, alternating, and writes a Markdown report
to bench/results/<date>-front-cpu.md. With --chaos S it then runs a steady load for S
seconds while SIGKILLing the engine every --kill-every seconds, and counts what clients saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "tiny"


# --- the front's process ------------------------------------------------------------------
async def _serve_front(sock: Path, poll_s: float) -> None:
    """Runs the Front on port 0, prints the port, and plays the supervisor's gate part."""
    from agent.config import FrontConfig
    from agent.front.proxy import Front
    from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
    from agent.supervisor.gate import EngineGate

    gate = EngineGate()
    metrics = Metrics(new_registry(), lambda: StatusView("running", True, None, (), NodeInfo()))
    front = Front(FrontConfig(port=0, queue={"deadline_s": 60}, max_resumes=5), gate, metrics)
    await front.start()
    print(front.port, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The engine is "the same one" while its socket file keeps its inode and answers health.
    seen: int | None = None
    session = None
    while not stop.is_set():
        try:
            inode = sock.stat().st_ino
        except FileNotFoundError:
            inode = None
        ok = False
        if inode is not None:
            if session is None or inode != seen:
                if session is not None:
                    await session.close()
                session = aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=str(sock)),
                    timeout=aiohttp.ClientTimeout(total=1))
            with contextlib.suppress(OSError, aiohttp.ClientError, TimeoutError):
                async with session.get("http://engine/health") as r:
                    ok = r.status == 200
        if gate.current is not None and (not ok or inode != seen):
            gate.close("engine stopped answering")
        if ok and gate.current is None:
            seen = inode
            gate.open(sock)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    if session is not None:
        await session.close()
    await front.stop(drain_timeout=5)
    failed = {s.labels["reason"]: s.value for m in metrics.registry.collect()
              for s in m.samples if s.name == "pitstop_front_failed_requests_total"}
    resumed = sum(s.value for m in metrics.registry.collect() for s in m.samples
                  if s.name == "pitstop_front_resumed_requests_total")
    print(json.dumps({"failed": failed, "resumed": resumed, "recoveries": gate.recovery}),
          flush=True)


# --- processes ----------------------------------------------------------------------------
class Engine:
    def __init__(self, model: Path, sock: Path, log: Path, slots: int) -> None:
        self.model, self.sock, self.log, self.slots = model, sock, log, slots
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.engines.refengine", "--model", str(self.model),
                 "--uds", str(self.sock), "--served-model-name", MODEL_NAME, "--device", "cpu",
                 "--kv-slots", str(self.slots)], stdout=log, stderr=log)

    async def ready(self) -> None:
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(OSError, aiohttp.ClientError):
                async with aiohttp.ClientSession(
                        connector=aiohttp.UnixConnector(path=str(self.sock))) as s, \
                        s.get("http://engine/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- load ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: the front's cost, whatever else loads the box."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    cpu: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0
    seconds: float = 0.0
    worst_gap: float = 0.0
    wrong: int = 0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]


@dataclass(frozen=True)
class Load:
    name: str
    method: str
    path: str
    body: dict[str, Any] | None
    concurrency: int


def loads() -> list[Load]:
    comp = {"model": MODEL_NAME, "prompt": "Once upon a time", "temperature": 0,
            "ignore_eos": True}
    return [
        Load("models (proxy overhead only)", "GET", "/v1/models", None, 1),
        Load("completions max_tokens=1, 1 client", "POST", "/v1/completions",
             {**comp, "max_tokens": 1}, 1),
        Load("completions max_tokens=32, 8 clients", "POST", "/v1/completions",
             {**comp, "max_tokens": 32}, 8),
        Load("streaming completions max_tokens=64, 8 clients", "POST", "/v1/completions",
             {**comp, "max_tokens": 64, "stream": True}, 8),
        Load("streaming chat max_tokens=64, 8 clients", "POST", "/v1/chat/completions",
             {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
              "temperature": 0, "ignore_eos": True, "max_tokens": 64, "stream": True}, 8),
    ]


def session_for(target: str, sock: Path, port: int) -> tuple[aiohttp.ClientSession, str]:
    if target == "direct":
        return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock), limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)), "http://engine"
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None)), \
        f"http://127.0.0.1:{port}"


async def one(s: aiohttp.ClientSession, base: str, load: Load, res: Result,
              expect: str | None = None) -> None:
    t0 = time.perf_counter()
    try:
        async with s.request(load.method, base + load.path, json=load.body) as r:
            if r.status != 200:
                await r.read()
                res.errors += 1
                return
            if load.body and load.body.get("stream"):
                parser_buf, text, last, first = b"", [], t0, None
                async for chunk in r.content.iter_any():
                    now = time.perf_counter()
                    first = first or now
                    res.worst_gap = max(res.worst_gap, now - last)
                    last = now
                    parser_buf += chunk
                    *events, parser_buf = parser_buf.split(b"\n\n")
                    for ev in events:
                        if not ev.startswith(b"data: {"):
                            continue
                        obj = json.loads(ev[6:])
                        if "error" in obj:
                            res.errors += 1
                            return
                        for c in obj.get("choices") or []:
                            res.tokens += 1
                            text.append(c.get("text") or (c.get("delta") or {}).get("content")
                                        or "")
                if first is not None:
                    res.ttfts.append(first - t0)
                if expect is not None and "".join(text) != expect:
                    res.wrong += 1
            else:
                body = await r.read()
                if load.body:
                    obj = json.loads(body)
                    res.tokens += obj["usage"]["completion_tokens"]
                    if expect is not None:
                        c = obj["choices"][0]
                        got = c.get("text") if "text" in c else c["message"]["content"]
                        res.wrong += got != expect
    except (aiohttp.ClientError, OSError, ValueError):
        res.errors += 1
        return
    res.latencies.append(time.perf_counter() - t0)


async def drive(target: str, sock: Path, port: int, load: Load, seconds: float,
                front_pid: int) -> Result:
    res = Result()
    s, base = session_for(target, sock, port)
    async with s:
        await one(s, base, load, Result())  # warm the connection
        end = time.perf_counter() + seconds
        start = time.perf_counter()
        cpu0 = cpu_seconds(front_pid)

        async def client() -> None:
            while time.perf_counter() < end:
                await one(s, base, load, res)

        await asyncio.gather(*(client() for _ in range(load.concurrency)))
        res.seconds = time.perf_counter() - start
        res.cpu = cpu_seconds(front_pid) - cpu0
    return res


# --- chaos ----------------------------------------------------------------------------------
async def chaos(engine: Engine, port: int, seconds: float, kill_every: float,
                concurrency: int, refs: dict[str, str]) -> dict[str, Any]:
    """Steady mixed load through the front; the engine is SIGKILLed every `kill_every` s."""
    stream_load = next(x for x in loads() if x.name.startswith("streaming completions"))
    chat_load = next(x for x in loads() if x.name.startswith("streaming chat"))
    whole_load = Load("whole", "POST", "/v1/completions",
                      {**stream_load.body, "stream": False}, 1)  # type: ignore[dict-item]
    mix = [stream_load, chat_load, whole_load]
    res = Result()
    sent = [0]
    end = time.perf_counter() + seconds
    kills = 0
    s, base = session_for("front", engine.sock, port)

    async def client(i: int) -> None:
        while time.perf_counter() < end:
            load = mix[(i + sent[0]) % len(mix)]
            sent[0] += 1
            await one(s, base, load, res, refs[load.path + str(bool(load.body.get("stream")))])

    async def killer() -> None:
        nonlocal kills
        while time.perf_counter() + kill_every < end:
            await asyncio.sleep(kill_every)
            engine.kill()
            kills += 1
            engine.start()
            await engine.ready()

    async with s:
        t0 = time.perf_counter()
        await asyncio.gather(killer(), *(client(i) for i in range(concurrency)))
        res.seconds = time.perf_counter() - t0
    return {"seconds": res.seconds, "kills": kills, "sent": sent[0],
            "completed": len(res.latencies) - res.wrong, "failed": res.errors,
            "wrong": res.wrong, "worst_stall_s": res.worst_gap,
            "p50_s": res.pct(res.latencies, 0.5), "p99_s": res.pct(res.latencies, 0.99),
            "max_s": max(res.latencies, default=float("nan"))}


async def references(sock: Path) -> dict[str, str]:
    """Greedy answers of the chaos loads, straight from the engine, keyed by path+stream."""
    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
        for load in loads()[3:]:
            body = {**load.body, "stream": False}  # type: ignore[dict-item]
            async with s.post("http://engine" + load.path, json=body) as r:
                c = (await r.json())["choices"][0]
            text = c["text"] if "text" in c else c["message"]["content"]
            out[load.path + "True"] = text
            if load.path == "/v1/completions":
                out[load.path + "False"] = text
    return out


# --- main -----------------------------------------------------------------------------------
def fmt_ms(x: float) -> str:
    return f"{x * 1000:.2f}"


async def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="pitstop-fbench-"))
    sock = work / "engine.sock"
    engine = Engine(args.model, sock, work / "engine.log", args.slots)
    engine.start()
    await engine.ready()
    front = subprocess.Popen([sys.executable, __file__, "_front", "--sock", str(sock),
                              "--loop", args.front_loop],
                             stdout=subprocess.PIPE, cwd=ROOT)
    assert front.stdout is not None
    port = int(front.stdout.readline())
    rows = []
    try:
        for load in loads():
            if args.only and args.only not in load.name:
                continue
            runs: dict[str, list[Result]] = {"direct": [], "front": []}
            for _ in range(args.rounds):
                for target in ("direct", "front"):
                    runs[target].append(await drive(target, sock, port, load, args.seconds,
                                                    front.pid))
            rows.append((load, runs))
            d, f = (_merge(runs[t]) for t in ("direct", "front"))
            print(f"{load.name}: direct {d.tput:.1f}/s p50 {fmt_ms(d.p50)} ms, front "
                  f"{f.tput:.1f}/s p50 {fmt_ms(f.p50)} ms", file=sys.stderr)
        chaos_out = None
        if args.chaos:
            refs = await references(sock)
            chaos_out = await chaos(engine, port, args.chaos, args.kill_every,
                                    args.chaos_clients, refs)
            print(f"chaos: {chaos_out}", file=sys.stderr)
    finally:
        front.send_signal(signal.SIGTERM)
        front_out = front.communicate(timeout=30)[0].decode().strip()
        engine.kill()
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    front_stats = json.loads(front_out.splitlines()[-1]) if front_out else {}
    return report(args, rows, chaos_out, front_stats)


@dataclass
class Merged:
    requests: int
    tokens: int
    cpu: float
    tput: float
    tok_s: float
    p50: float
    p99: float
    ttft50: float
    errors: int


def _merge(results: list[Result]) -> Merged:
    lat = [x for r in results for x in r.latencies]
    tt = [x for r in results for x in r.ttfts]
    secs = sum(r.seconds for r in results)
    r0 = Result()
    return Merged(requests=len(lat), tokens=sum(r.tokens for r in results),
                  cpu=sum(r.cpu for r in results), tput=len(lat) / secs,
                  tok_s=sum(r.tokens for r in results) / secs,
                  p50=r0.pct(lat, 0.5), p99=r0.pct(lat, 0.99), ttft50=r0.pct(tt, 0.5),
                  errors=sum(r.errors for r in results))


def report(args: argparse.Namespace, rows: list[Any], chaos_out: dict[str, Any] | None,
           front_stats: dict[str, Any]) -> str:
    now = datetime.datetime.now(datetime.UTC)
    lines = [
        f"# Front vs direct, CPU ({now:%Y-%m-%d})", "",
        f"- date: {now:%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, "
        f"Python {platform.python_version()}; load average at start "
        f"{os.getloadavg()[0]:.1f} (a machine shared with other work)",
        f"- command: `{' '.join(['python', 'bench/front_bench.py', *sys.argv[1:]])}`",
        f"- front's event loop: {args.front_loop}",
        f"- engine: the reference engine on CPU, tiny model, {args.slots} KV slots, greedy; "
        f"each load {args.seconds:g} s per target per round, {args.rounds} rounds, "
        "direct and front alternating",
        "- direct: the engine's Unix socket; front: the front's TCP port on 127.0.0.1, "
        "forwarding to that socket (its own process)",
        "",
        "| load | target | req/s | tokens/s | p50 ms | p99 ms | TTFT p50 ms | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    summary = ["", "| load | throughput change | added p50 ms | added p99 ms | front CPU "
               "per request ms | front CPU per token us |",
               "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for load, runs in rows:
        d, f = _merge(runs["direct"]), _merge(runs["front"])
        for name, m in (("direct", d), ("front", f)):
            lines.append(f"| {load.name} | {name} | {m.tput:.1f} | {m.tok_s:.0f} | "
                         f"{fmt_ms(m.p50)} | {fmt_ms(m.p99)} | "
                         f"{fmt_ms(m.ttft50) if m.ttft50 == m.ttft50 else '-'} | {m.errors} |")
        per_tok = f"{1e6 * f.cpu / f.tokens:.0f}" if f.tokens else "-"
        summary.append(f"| {load.name} | {100 * (f.tput / d.tput - 1):+.1f} % | "
                       f"{fmt_ms(f.p50 - d.p50)} | {fmt_ms(f.p99 - d.p99)} | "
                       f"{fmt_ms(f.cpu / max(1, f.requests))} | {per_tok} |")
    lines += summary
    if chaos_out is not None:
        c = chaos_out
        lines += [
            "", f"## Chaos: engine SIGKILLed every {args.kill_every:g} s for "
            f"{c['seconds']:.0f} s", "",
            f"{args.chaos_clients} clients in a loop over streaming completions, streaming "
            "chat and non-streaming completions (max_tokens=64, greedy), each answer "
            "compared with the engine's uninterrupted one. The watcher in the front's process "
            "closes the gate when the engine stops answering and opens it for the new one "
            "(the supervisor's part).", "",
            "| kills | requests sent | completed and correct | failed | wrong text | "
            "worst stall s | p50 s | p99 s | max s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {c['kills']} | {c['sent']} | {c['completed']} | {c['failed']} | {c['wrong']} "
            f"| {c['worst_stall_s']:.2f} | {c['p50_s']:.2f} | {c['p99_s']:.2f} | "
            f"{c['max_s']:.2f} |", "",
            f"Front's own counts: resumed {front_stats.get('resumed', 0):g}, failed "
            f"{front_stats.get('failed') or {}}, recoveries seen "
            f"{front_stats.get('recoveries', '?')}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    f = sub.add_parser("_front", help="internal: the front's process")
    f.add_argument("--sock", type=Path, required=True)
    f.add_argument("--poll", type=float, default=0.05)
    f.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/pitstop/tiny-llama")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--chaos", type=float, default=0.0, help="seconds of chaos run (0: none)")
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--chaos-clients", type=int, default=8)
    p.add_argument("--front-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the front process's event loop (uvloop must be installed)")
    p.add_argument("--only", default="", help="run only the loads whose name has this")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.cmd == "_front":
        factory = None
        if args.loop == "uvloop":
            import uvloop

            factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve_front(args.sock, args.poll))
        return 0
    text = asyncio.run(run(args))
    out = args.out or ROOT / "bench" / "results" / (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}-front-cpu.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
