"""Kept KV across an engine crash: the gap from SIGKILL to the next token, kept vs re-prefill.

Runs `pitstop run` with the reference engine and a `pitstop holder` (the engine keeps its
weights, KV pool and KV ledger there), takes a hybrid snapshot, then for each prompt
length streams a greedy completion straight to the engine's socket, SIGKILLs the engine
after --cut tokens and, once the agent has restored it, sends the continuation the front
sends (prompt + the tokens received, `X-Pitstop-Resume`). Two modes, alternated run by
run so both see the same machine state:

- kept: the continuation names the dead request (`X-Pitstop-Request`), so the restored
  engine finds its ledger entry and continues from the kept KV;
- reprefill: it names a request no ledger holds, so the engine prefills the whole context
  again (what every resume did before kept KV).

The gap is the time from the SIGKILL to the continuation's first token: the restore plus
the continuation's prefill. Then the serving cost of the pool in the holder: the engine
alone, --concurrency streams at once, with `--keep-kv` and with `--no-keep-kv` (a private
pool), tokens per second and the time between tokens. Not part of `make test`. On the
H200, from the repository root (about 3 minutes):

    sysctl -w kernel.io_uring_disabled=2
    PITSTOP_CRIU=$PWD/.gpu/criu/bin/criu python3 bench/kv_keep_bench.py OUT

A dry run on CPU: `python3 bench/kv_keep_bench.py OUT --device cpu --gib 0.002
--prompts 256,1024 --runs 2`. Writes OUT/kv-keep.json (rows: engine, path, gib, runs_s,
median_s, machine, command) after every phase, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_recovery_bench import (  # noqa: E402
    Agent,
    first_snapshot,
    gpu_id,
    log,
    machine,
    start_holder,
    stop_process,
)

REPO = Path(__file__).resolve().parent.parent
REQUEST, RESUME, KV, KV_KEPT = ("X-Pitstop-Request", "X-Pitstop-Resume", "X-Pitstop-KV",
                                "X-Pitstop-KV-Kept")


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 600) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def open_stream(sock: str, prompt: list[int], max_tokens: int, headers: dict[str, str]
                ) -> tuple[UnixHTTP, http.client.HTTPResponse]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})
    c = UnixHTTP(sock)
    c.request("POST", "/v1/completions", body=body,
              headers={"Content-Type": "application/json", **headers})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"engine answered {r.status}: {r.read()[:500]!r}")
    return c, r


def token_events(r: http.client.HTTPResponse):
    """Yields (time, ids) per event with token ids."""
    while True:
        line = r.readline()
        if not line:
            return
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:])["choices"]
            ids = choices[0].get("token_ids") or [] if choices else []
            if ids:
                yield time.monotonic(), ids


def ready_again(agent: Agent, restarts: int, timeout: float = 600) -> dict:
    """The agent's status once it has the engine back; polled often, as the gap counts it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = agent.status()
        if st.get("restarts") == restarts and st.get("state") == "ready":
            return st
        if st.get("state") == "failed" or agent.p.poll() is not None:
            raise SystemExit(f"the agent failed waiting for the restore: {st.get('reason')}")
        time.sleep(0.005)
    raise SystemExit(f"timed out waiting for the restore: {agent.status()}")


def cut_run(agent: Agent, sock: str, prompt: list[int], cut: int, decode: int,
            keep: bool) -> dict:
    """One stream SIGKILLed after `cut` tokens; the continuation's first token timed."""
    key = uuid.uuid4().hex
    st = agent.status()
    restarts, pid = st["restarts"], st["engine_pid"]
    c, r = open_stream(sock, prompt, decode, {REQUEST: key})
    got: list[int] = []
    t_first = None
    for t, ids in token_events(r):
        t_first = t_first or t
        got += ids
        if len(got) >= cut:
            break
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    c.close()
    st = ready_again(agent, restarts + 1)
    t_ready = time.monotonic()
    c, r = open_stream(sock, prompt + got, decode - len(got),
                       {REQUEST: key if keep else uuid.uuid4().hex, RESUME: str(len(got))})
    outcome, kept = r.getheader(KV, ""), int(r.getheader(KV_KEPT, "0") or 0)
    t_next = next(token_events(r))[0]
    c.close()
    rec = st["last_recovery"]
    return {"gap_s": round(t_next - t_kill, 4), "ready_s": round(t_ready - t_kill, 4),
            "resume_first_token_s": round(t_next - t_ready, 4), "outcome": outcome,
            "kept_positions": kept, "recovery_path": rec.get("path"),
            "recovery_s": rec.get("duration_s")}


def throughput(model: Path, device: str, holder_sock: Path, keep: bool, slots: int,
               max_len: int, prompt: list[int], decode: int, rounds: int) -> dict:
    """The engine alone, `slots` streams at once for `rounds` rounds: tokens/s, and the
    time between tokens."""
    with tempfile.TemporaryDirectory(prefix="kvkeep-") as tmp:
        sock = str(Path(tmp) / "engine.sock")
        logf = Path(tmp) / "engine.log"
        argv = [sys.executable, "-m", "agent.engines.refengine", "--model", str(model),
                "--uds", sock, "--device", device, "--kv-slots", str(slots),
                "--max-model-len", str(max_len), "--prefill-chunk", "512",
                "--holder", str(holder_sock), "--weights-digest", "sha256-kvkeep-bench",
                "--keep-kv" if keep else "--no-keep-kv"]
        if device == "cuda":
            argv += ["--dtype", "bfloat16"]
        p = subprocess.Popen(argv, cwd=REPO, stdout=logf.open("w"), stderr=subprocess.STDOUT)
        try:
            end = time.monotonic() + 600
            while not os.path.exists(sock):
                if p.poll() is not None or time.monotonic() > end:
                    raise SystemExit(f"engine did not start: {logf.read_text()[-2000:]}")
                time.sleep(0.1)

            def one(_: int) -> tuple[int, list[float]]:
                c, r = open_stream(sock, prompt, decode, {})
                times = [t for t, _ids in token_events(r)]
                c.close()
                return len(times), [b - a for a, b in zip(times, times[1:], strict=False)]

            one(0)  # warm-up: graphs captured, caches filled
            walls = []
            gaps: list[float] = []
            tokens = 0
            for _ in range(rounds):
                t0 = time.monotonic()
                with ThreadPoolExecutor(slots) as ex:
                    for n, g in ex.map(one, range(slots)):
                        tokens += n
                        gaps += g
                walls.append(time.monotonic() - t0)
            return {"tokens_per_s": round(tokens / sum(walls), 2), "round_s": walls,
                    "inter_token_median_s": round(statistics.median(gaps), 5),
                    "inter_token_p99_s": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))], 5)}
        finally:
            stop_process(p, 60)


def rows(result: dict, gib: float, command: str) -> list[dict]:
    where, host = machine()
    out = []
    for n, runs in sorted(result.get("cuts", {}).items(), key=lambda kv: int(kv[0])):
        for mode in ("kept", "reprefill"):
            gaps = [r["gap_s"] for r in runs.get(mode, [])]
            if gaps:
                out.append({"engine": "reference", "path": f"kill-to-next-token/{mode}/{n}tok",
                            "gib": gib, "runs_s": gaps, "median_s": statistics.median(gaps),
                            "machine": where, "host": host, "command": command,
                            "outcomes": [r["outcome"] for r in runs[mode]],
                            "resume_first_token_s": [r["resume_first_token_s"]
                                                     for r in runs[mode]]})
    for mode, t in result.get("throughput", {}).items():
        out.append({"engine": "reference", "path": f"serving/{mode}", "gib": gib,
                    "runs_s": t["round_s"], "median_s": statistics.median(t["round_s"]),
                    "machine": where, "host": host, "command": command, **t})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gib", type=float, default=1.0, help="model weights (bf16)")
    ap.add_argument("--prompts", default="4096,16384", help="prompt lengths in tokens")
    ap.add_argument("--runs", type=int, default=5, help="kills per prompt length and mode")
    ap.add_argument("--cut", type=int, default=8, help="tokens received before the kill")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="throughput: streams at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--work", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--budget-s", type=float, default=270,
                    help="stop starting new runs after this long, keeping what was measured "
                         "(the device call this is made for has 5 minutes)")
    a = ap.parse_args()
    started = time.monotonic()

    def over_budget(what: str) -> bool:
        if time.monotonic() - started < a.budget_s:
            return False
        result["cut_short"] = f"--budget-s {a.budget_s:g} spent before {what}"
        log(result["cut_short"])
        return True

    a.out.mkdir(parents=True, exist_ok=True)
    prompts = [int(x) for x in a.prompts.split(",")]
    max_len = max(prompts) + a.decode + 64
    work = a.work or Path(tempfile.mkdtemp(prefix="kvkeep-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = " ".join(["python3", *sys.argv])
    result: dict = {"gib": a.gib, "prompts": prompts, "runs": a.runs, "cut": a.cut,
                    "host": os.uname().nodename, "cuts": {}, "throughput": {}}
    out = a.out / "kv-keep.json"

    def save() -> None:
        result["rows"] = rows(result, a.gib, command)
        result["written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        out.write_text(json.dumps(result, indent=1))

    model = work / "model"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "agent", "make-model", str(model), "--target-gib",
                    str(a.gib), "--max-position-embeddings", str(max_len)], cwd=REPO,
                   check=True, env={**os.environ, "PITSTOP_MODELGEN_DEVICE": a.device})
    log(f"model {model} in {time.monotonic() - t0:.1f}s, max_len {max_len}")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    # Ids above the specials; a random prompt: the model only has to run over it.
    prompt_of = {n: [rng.randrange(16, vocab) for _ in range(n)] for n in prompts}

    gpu = gpu_id(a.device)
    holder_dir = work / "holder"
    holder = start_holder(gpu, holder_dir, work)
    engine_args = ["--kv-slots", str(a.slots), "--max-model-len", str(max_len),
                   "--prefill-chunk", "512"]
    if a.device == "cuda":
        engine_args += ["--dtype", "bfloat16"]
    cfg = {
        "engine": {"kind": "reference", "model": str(model), "device": a.device,
                   "args": engine_args, "stop_timeout_s": 30},
        "paths": {"state_dir": str(work / "state")},
        "front": {"host": "127.0.0.1", "port": 0},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "health": {"start_timeout_s": 900, "timeout_s": 5},
        # Kills on purpose, back to back: no backoff in the gap, no crash-loop verdict.
        "restart": {"backoff_initial_s": 0, "backoff_max_s": 0.001, "crash_loop_limit": 1000,
                    "crash_loop_window_s": 1},
        "snapshots": {"drift_check_interval_s": 0, "quiet_timeout_s": 60},
        "holder": {"enabled": True, "dir": str(holder_dir), "gpu": gpu},
    }
    try:
        agent = Agent(cfg, work)
        try:
            st = agent.wait(lambda s: s.get("state") == "ready", 900, "first start")
            log(f"first start {st['last_recovery']['duration_s']:.2f}s")
            result["snapshot"] = first_snapshot(agent)
            sock = str(work / "state" / "run" / "engine.sock")
            for n in prompts:
                runs: dict[str, list[dict]] = {"kept": [], "reprefill": []}
                result["cuts"][str(n)] = runs
                for i in range(a.runs):
                    if over_budget(f"run {i + 1} of {n} tokens"):
                        break
                    for mode in ("kept", "reprefill"):
                        r = cut_run(agent, sock, prompt_of[n], a.cut, a.decode, mode == "kept")
                        runs[mode].append(r)
                        log(f"{n} tokens, {mode} {i + 1}/{a.runs}: {r}")
                save()
        finally:
            agent.stop()
            shutil.copy(work / "agent.log", a.out / "agent.log")
        tp_prompt = prompt_of[min(prompts)][:512]
        for mode, keep in (("holder", True), ("private", False)):
            if over_budget(f"throughput with the pool {mode}"):
                break
            result["throughput"][mode] = t = throughput(
                model, a.device, holder_dir / gpu / "holder.sock", keep, a.concurrency,
                max_len, tp_prompt, 128, a.rounds)
            log(f"throughput, pool {mode}: {t}")
            save()
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(120)
        shutil.copy(work / "holder.log", a.out / "holder.log")
    save()
    log("wrote", out)


if __name__ == "__main__":
    main()
