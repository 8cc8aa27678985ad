"""The front's cost and its crash-hiding, measured: front vs direct, and a chaos run.

    python bench/front_bench.py --model DIR [--seconds 15] [--rounds 2] [--chaos 180]
    python bench/front_bench.py --engine-device cuda --pin --seconds 8 --rounds 2 --out OUT

Starts the reference engine on a Unix socket and the front in a process of its own (with a
small watcher standing in for the supervisor: it closes the gate when the engine stops
answering and opens it for each new engine), then drives the same loads straight at the
engine's socket and through the front's TCP port, alternating, and writes a Markdown report
and the same figures as JSON to --out (default bench/results/), named
<date>-front-<device>.md/.json (never over an existing file). With --chaos S it then runs a
steady load for S seconds while SIGKILLing the engine every --kill-every seconds, and
counts what clients saw.

--pin gives the engine, the front and this load generator disjoint CPUs (whole SMT sibling
groups where the kernel reports them): the front's cost then shows as its own core's time,
not as cycles taken from a CPU-bound engine. A missing --model directory is made first
(`python -m agent make-model`, --model-gib for a bigger one, on --engine-device).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
# The agent from this checkout, installed or not (as on the GPU machine).
sys.path.insert(0, str(ROOT))
MODEL_NAME = "tiny"
START = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f} s] {msg}", file=sys.stderr, flush=True)


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
    def __init__(self, model: Path, sock: Path, log: Path, slots: int, device: str = "cpu",
                 cpus: list[int] | None = None) -> None:
        self.model, self.sock, self.log, self.slots = model, sock, log, slots
        self.device, self.cpus = device, cpus
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.engines.refengine", "--model", str(self.model),
                 "--uds", str(self.sock), "--served-model-name", MODEL_NAME, "--device",
                 self.device, "--kv-slots", str(self.slots)], stdout=log, stderr=log, cwd=ROOT,
                preexec_fn=pinner(self.cpus))

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


# --- CPU pinning ------------------------------------------------------------------------------
def pinner(cpus: list[int] | None) -> Any:
    """A preexec_fn that pins the child before it starts a thread (all inherit the mask)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def sibling_groups(cpus: list[int], sysfs: Path = Path("/sys/devices/system/cpu")
                   ) -> list[list[int]]:
    """The CPUs grouped by physical core (SMT siblings together), in CPU order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in cpus:
        try:
            sib = parse_cpus((sysfs / f"cpu{c}/topology/thread_siblings_list").read_text())
        except (OSError, ValueError):
            sib = [c]
        groups.setdefault(tuple(sorted(sib)), []).append(c)
    return sorted(groups.values())


def parse_cpus(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def pin_layout(cpus: list[int], spec: str = "") -> tuple[dict[str, list[int]], str]:
    """CPU sets for 'engine', 'front' and 'load', and a note on how they were chosen.

    `spec` ('engine=0-11,front=12,load=13-15') is taken as given. Otherwise the front gets
    the last physical core and the load generator the one before it (each is one Python
    process: more would not help), the engine the rest. Below three cores nothing can be
    disjoint: the front and the load generator share the last CPU (a dry run only).
    """
    if spec:
        layout = {}
        for item in spec.split(","):
            name, _, cpu_list = item.partition("=")
            layout[name.strip()] = parse_cpus(cpu_list)
        if set(layout) != {"engine", "front", "load"}:
            raise SystemExit(f"--pin-layout {spec!r}: name engine=, front= and load= CPUs")
        return layout, "as given by --pin-layout"
    groups = sibling_groups(cpus)
    if len(groups) >= 3:
        return ({"engine": [c for g in groups[:-2] for c in g], "load": groups[-2],
                 "front": groups[-1]},
                f"{len(cpus)} CPUs in {len(groups)} physical cores: disjoint")
    return ({"engine": cpus[:1], "front": cpus[-1:], "load": cpus[-1:]},
            f"only {len(cpus)} CPUs: NOT disjoint, the front and the load generator share "
            f"CPU {cpus[-1]} (a dry run of --pin, not a measurement of it)")


# --- load ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: the front's cost, whatever else loads the box."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    cpu: float = 0.0  # the front's CPU seconds
    engine_cpu: float = 0.0
    load_cpu: float = 0.0  # this load generator's own
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
                front_pid: int, engine_pid: int | None = None) -> Result:
    res = Result()
    s, base = session_for(target, sock, port)
    async with s:
        await one(s, base, load, Result())  # warm the connection
        end = time.perf_counter() + seconds
        start = time.perf_counter()
        cpu0 = cpu_seconds(front_pid)
        eng0 = cpu_seconds(engine_pid) if engine_pid else 0.0
        load0 = time.process_time()

        async def client() -> None:
            while time.perf_counter() < end:
                await one(s, base, load, res)

        await asyncio.gather(*(client() for _ in range(load.concurrency)))
        res.seconds = time.perf_counter() - start
        res.cpu = cpu_seconds(front_pid) - cpu0
        res.engine_cpu = cpu_seconds(engine_pid) - eng0 if engine_pid else 0.0
        res.load_cpu = time.process_time() - load0
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


def machine_info() -> dict[str, Any]:
    """What the figures depend on: CPUs, GPU, kernel, Python, load."""
    info: dict[str, Any] = {
        "host": platform.node(), "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)), "platform": platform.platform(),
        "python": platform.python_version(), "load_average": os.getloadavg()[0]}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0:
            info["gpus"] = [g.strip() for g in out.stdout.splitlines() if g.strip()]
    return info


def model_info(model: Path) -> str:
    with contextlib.suppress(OSError, ValueError, KeyError):
        cfg = json.loads((model / "config.json").read_text())
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        return (f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                f"{cfg.get('torch_dtype', '?')}, {size / 1e6:.1f} MB of weights")
    return "?"


def ensure_model(args: argparse.Namespace) -> None:
    """Make --model if it is missing (the GPU machine starts bare)."""
    if (args.model / "config.json").exists():
        return
    cmd = [sys.executable, "-m", "agent", "make-model", str(args.model)]
    if args.model_gib:
        cmd += ["--target-gib", str(args.model_gib)]
    progress(f"making the model: {shlex.join(cmd)}")
    subprocess.run(cmd, cwd=ROOT, check=True,
                   env={**os.environ, "PITSTOP_MODELGEN_DEVICE": args.engine_device})


def estimate_s(args: argparse.Namespace, n_loads: int) -> float:
    # Per load and round: both targets plus a warm-up request each; then the chaos run.
    return n_loads * args.rounds * 2 * (args.seconds + 0.5) + args.chaos + 15


async def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = machine_info()
    layout: dict[str, list[int]] = {}
    if args.pin:
        layout, how = pin_layout(sorted(os.sched_getaffinity(0)), args.pin_layout)
        machine["pinning"] = {**layout, "how": how}
        progress(f"pinning: engine {layout['engine']}, front {layout['front']}, load "
                 f"generator {layout['load']} ({how})")
    work = Path(tempfile.mkdtemp(prefix="pitstop-fbench-"))
    sock = work / "engine.sock"
    engine = Engine(args.model, sock, work / "engine.log", args.slots, args.engine_device,
                    layout.get("engine"))
    selected = [x for x in loads() if not args.only or args.only in x.name]
    progress(f"starting the engine on {args.engine_device}; about "
             f"{estimate_s(args, len(selected)):.0f} s in all")
    engine.start()
    front: subprocess.Popen[bytes] | None = None
    rows = []
    chaos_out = None
    try:
        await asyncio.wait_for(engine.ready(), args.engine_timeout)
        front = subprocess.Popen([sys.executable, __file__, "_front", "--sock", str(sock),
                                  "--loop", args.front_loop],
                                 stdout=subprocess.PIPE, cwd=ROOT,
                                 preexec_fn=pinner(layout.get("front")))
        assert front.stdout is not None
        port = int(front.stdout.readline())
        if layout:
            os.sched_setaffinity(0, layout["load"])  # after the children: they set their own
            machine["pinning"]["seen"] = {
                "engine": sorted(os.sched_getaffinity(engine.proc.pid)),  # type: ignore[union-attr]
                "front": sorted(os.sched_getaffinity(front.pid)),
                "load": sorted(os.sched_getaffinity(0))}
        # The engine's first generations pay its warm-up (allocations; on a GPU, kernel
        # loading): spent here, not on whichever target happens to go first.
        refs = await references(sock)
        # The front's CPU with no request: the watcher above polls /health (the supervisor's
        # part, not the front's); subtracted from the per-token and per-request figures.
        idle0 = cpu_seconds(front.pid)
        await asyncio.sleep(3)
        machine["front_idle_cpu_share"] = (cpu_seconds(front.pid) - idle0) / 3
        progress(f"engine and front ready, engine warmed up; the front idles at "
                 f"{100 * machine['front_idle_cpu_share']:.1f} % of a core")
        for i, load in enumerate(selected, 1):
            runs: dict[str, list[Result]] = {"direct": [], "front": []}
            for r in range(args.rounds):
                for target in ("direct", "front"):
                    progress(f"load {i}/{len(selected)} '{load.name}', round {r + 1}/"
                             f"{args.rounds}, {target}")
                    runs[target].append(await drive(target, sock, port, load, args.seconds,
                                                    front.pid, engine.proc.pid))  # type: ignore[union-attr]
            rows.append((load, runs))
            d, f = (_merge(runs[t]) for t in ("direct", "front"))
            progress(f"{load.name}: direct {d.tput:.1f}/s p50 {fmt_ms(d.p50)} ms, front "
                     f"{f.tput:.1f}/s p50 {fmt_ms(f.p50)} ms ({100 * (f.tput / d.tput - 1):+.1f}"
                     " %)")
        if args.chaos:
            progress(f"chaos: {args.chaos:g} s, the engine SIGKILLed every {args.kill_every:g} s")
            chaos_out = await chaos(engine, port, args.chaos, args.kill_every,
                                    args.chaos_clients, refs)
            progress(f"chaos: {chaos_out}")
    except BaseException:
        log = (work / "engine.log").read_text(errors="replace")[-3000:]
        progress(f"failed; the engine's log ends with:\n{log}")
        raise
    finally:
        front_out = ""
        if front is not None:
            front.send_signal(signal.SIGTERM)
            front_out = front.communicate(timeout=30)[0].decode().strip()
        engine.kill()
        shutil.rmtree(work, ignore_errors=True)
    front_stats = json.loads(front_out.splitlines()[-1]) if front_out else {}
    machine["load_average_end"] = os.getloadavg()[0]
    return {"machine": machine, "rows": rows, "chaos": chaos_out, "front_stats": front_stats}


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
    seconds: float
    engine_cpu: float
    load_cpu: float


def _merge(results: list[Result]) -> Merged:
    lat = [x for r in results for x in r.latencies]
    tt = [x for r in results for x in r.ttfts]
    secs = sum(r.seconds for r in results)
    r0 = Result()
    return Merged(requests=len(lat), tokens=sum(r.tokens for r in results),
                  cpu=sum(r.cpu for r in results), tput=len(lat) / secs,
                  tok_s=sum(r.tokens for r in results) / secs,
                  p50=r0.pct(lat, 0.5), p99=r0.pct(lat, 0.99), ttft50=r0.pct(tt, 0.5),
                  errors=sum(r.errors for r in results), seconds=secs,
                  engine_cpu=sum(r.engine_cpu for r in results),
                  load_cpu=sum(r.load_cpu for r in results))


def command_line() -> str:
    argv0 = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        argv0 = argv0.relative_to(Path.cwd())
    return shlex.join(["python", str(argv0), *sys.argv[1:]])


def summary_of(rows: list[Any], idle_share: float = 0.0) -> list[dict[str, Any]]:
    out = []
    for load, runs in rows:
        d, f = _merge(runs["direct"]), _merge(runs["front"])
        net = max(0.0, f.cpu - idle_share * f.seconds)  # less the watcher's polling
        out.append({
            "load": load.name, "direct": asdict(d), "front": asdict(f),
            "throughput_change_pct": 100 * (f.tput / d.tput - 1),
            "added_p50_ms": 1000 * (f.p50 - d.p50), "added_p99_ms": 1000 * (f.p99 - d.p99),
            "front_cpu_per_request_ms": 1000 * net / max(1, f.requests),
            "front_cpu_per_token_us": 1e6 * net / f.tokens if f.tokens else None,
            "front_core_busy_pct": 100 * f.cpu / f.seconds,
        })
    return out


def report(args: argparse.Namespace, out: dict[str, Any]) -> str:
    m, rows, chaos_out, front_stats = (out["machine"], out["rows"], out["chaos"],
                                       out["front_stats"])
    now = datetime.datetime.now(datetime.UTC)
    gpus = "; GPU: " + ", ".join(m["gpus"]) if m.get("gpus") else "; no GPU"
    pin = m.get("pinning")
    lines = [
        f"# Front vs direct, reference engine on {args.engine_device} ({now:%Y-%m-%d})", "",
        f"- date: {now:%Y-%m-%d %H:%M} UTC",
        f"- machine: {m['host']}, {m['cpus']} CPUs ({m['cpus_usable']} usable, "
        f"{m.get('cpu_model', '?')}){gpus}; {m['platform']}, Python {m['python']}",
        f"- load average (1 min) at start {m['load_average']:.1f}, at end "
        f"{m['load_average_end']:.1f}",
        f"- command: `{command_line()}`",
        f"- front's event loop: {args.front_loop}",
        f"- engine: the reference engine on {args.engine_device}, model "
        f"{model_info(args.model)}, {args.slots} KV slots, greedy; each load "
        f"{args.seconds:g} s per target per round, {args.rounds} rounds, direct and front "
        "alternating",
        "- direct: the engine's Unix socket; front: the front's TCP port on 127.0.0.1, "
        "forwarding to that socket (its own process)",
        f"- the front's process idles at {100 * m.get('front_idle_cpu_share', 0.0):.1f} % of "
        "a core (its watcher polls the engine's /health every 50 ms, standing in for the "
        "supervisor); the per-request and per-token CPU figures are net of it, the busy "
        "column is not",
        "- CPU pinning: " + (f"engine {pin['engine']}, front {pin['front']}, load generator "
                             f"{pin['load']} ({pin['how']})" if pin else
                             "none (the engine, the front and the load generator share all "
                             "CPUs)"),
        "",
        "| load | target | req/s | tokens/s | p50 ms | p99 ms | TTFT p50 ms | errors | "
        "engine CPU % | load gen CPU % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    summary = ["", "| load | throughput change | added p50 ms | added p99 ms | front CPU "
               "per request ms | front CPU per token us | front's core busy % |",
               "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    idle = m.get("front_idle_cpu_share", 0.0)
    for (load, runs), sm in zip(rows, summary_of(rows, idle), strict=True):
        d, f = _merge(runs["direct"]), _merge(runs["front"])
        for name, x in (("direct", d), ("front", f)):
            lines.append(f"| {load.name} | {name} | {x.tput:.1f} | {x.tok_s:.0f} | "
                         f"{fmt_ms(x.p50)} | {fmt_ms(x.p99)} | "
                         f"{fmt_ms(x.ttft50) if x.ttft50 == x.ttft50 else '-'} | {x.errors} | "
                         f"{100 * x.engine_cpu / x.seconds:.0f} | "
                         f"{100 * x.load_cpu / x.seconds:.0f} |")
        per_tok = sm["front_cpu_per_token_us"]
        summary.append(f"| {load.name} | {sm['throughput_change_pct']:+.1f} % | "
                       f"{sm['added_p50_ms']:.2f} | {sm['added_p99_ms']:.2f} | "
                       f"{sm['front_cpu_per_request_ms']:.2f} | "
                       f"{f'{per_tok:.0f}' if per_tok is not None else '-'} | "
                       f"{sm['front_core_busy_pct']:.0f} |")
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


def _finite(x: Any) -> Any:
    """NaN (no sample) as null: JSON has no NaN."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def as_json(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    return _finite({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": command_line(), "args": {k: str(v) for k, v in vars(args).items()},
            "machine": out["machine"], "model": model_info(args.model),
            "loads": summary_of(out["rows"], out["machine"].get("front_idle_cpu_share", 0.0)),
            "chaos": out["chaos"],
            "front_stats": out["front_stats"]})


def free_name(directory: Path, stem: str) -> Path:
    """directory/stem, or stem-2, stem-3...: a run never replaces an earlier one's file."""
    n, name = 1, stem
    while (directory / f"{name}.md").exists() or (directory / f"{name}.json").exists():
        n += 1
        name = f"{stem}-{n}"
    return directory / name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    f = sub.add_parser("_front", help="internal: the front's process")
    f.add_argument("--sock", type=Path, required=True)
    f.add_argument("--poll", type=float, default=0.05)
    f.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/pitstop/tiny-llama",
                   help="model directory; made (tiny, or --model-gib) when missing")
    p.add_argument("--model-gib", type=float, default=0.0,
                   help="when --model is missing, make a bf16 model of about this many GiB")
    p.add_argument("--engine-device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--engine-timeout", type=float, default=300.0,
                   help="seconds for the engine to answer /health")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--chaos", type=float, default=0.0, help="seconds of chaos run (0: none)")
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--chaos-clients", type=int, default=8)
    p.add_argument("--front-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the front process's event loop (uvloop must be installed)")
    p.add_argument("--only", default="", help="run only the loads whose name has this")
    p.add_argument("--pin", action="store_true",
                   help="disjoint CPUs for the engine, the front and the load generator")
    p.add_argument("--pin-layout", default="", metavar="engine=CPUS,front=CPUS,load=CPUS",
                   help="with --pin: these CPU lists instead of the automatic split")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="directory for <date>-front-<device>.md and .json")
    args = p.parse_args()
    if args.cmd == "_front":
        factory = None
        if args.loop == "uvloop":
            import uvloop

            factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve_front(args.sock, args.poll))
        return 0
    if args.pin_layout and not args.pin:
        p.error("--pin-layout needs --pin")
    args.model = args.model.resolve()
    ensure_model(args)
    out = asyncio.run(run(args))
    text = report(args, out)
    args.out.mkdir(parents=True, exist_ok=True)
    base = free_name(args.out, f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}-front-"
                               f"{args.engine_device}")
    base.with_suffix(".md").write_text(text)
    base.with_suffix(".json").write_text(json.dumps(as_json(args, out), indent=1) + "\n")
    print(text)
    progress(f"wrote {base}.md and {base}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
