"""Time the reference engine: start to healthy, time to first token, tokens per second.

    python bench/refengine_bench.py --model DIR [--concurrency 4] [--requests 16]
        [--max-tokens 64] [--device cpu] [-- extra engine args]

Starts `python -m agent.engines.refengine` on a temporary Unix socket, sends greedy
streaming completions, prints one JSON object. Numbers are for comparing runs on the
same machine, not for claims about real engines.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2


def one_request(sock: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, total time, tokens) of one streamed greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    transport = httpx2.HTTPTransport(uds=sock)
    with httpx2.Client(transport=transport, base_url="http://localhost", timeout=600) as c:
        t0 = time.monotonic()
        first, tokens = None, 0
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    n = len(choices[0].get("token_ids") or []) if choices else 0
                    if n and first is None:
                        first = time.monotonic() - t0
                    tokens += n
        return first or 0.0, time.monotonic() - t0, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("engine_args", nargs="*", help="passed to the engine after --")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="refbench-") as tmp:
        sock = str(Path(tmp) / "engine.sock")
        argv = [sys.executable, "-m", "agent.engines.refengine", "--model", str(args.model),
                "--uds", sock, "--device", args.device,
                "--kv-slots", str(args.concurrency), *args.engine_args]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
        try:
            transport = httpx2.HTTPTransport(uds=sock)
            with httpx2.Client(transport=transport, base_url="http://localhost") as c:
                while True:
                    if proc.poll() is not None:
                        print(f"engine exited with {proc.returncode}", file=sys.stderr)
                        return 1
                    try:
                        if c.get("/health", timeout=2).status_code == 200:
                            break
                    except httpx2.TransportError:
                        time.sleep(0.05)
            startup = time.monotonic() - t0
            prompts = [f"Request {i}: the engine ran along the river and" for i in
                       range(args.requests)]
            t1 = time.monotonic()
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                results = list(pool.map(lambda pr: one_request(sock, pr, args.max_tokens),
                                        prompts))
            wall = time.monotonic() - t1
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    ttft = sorted(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    print(json.dumps({
        "model": str(args.model), "device": args.device, "concurrency": args.concurrency,
        "requests": args.requests, "max_tokens": args.max_tokens,
        "engine_args": args.engine_args,
        "startup_to_healthy_s": round(startup, 3),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_max_s": round(ttft[-1], 4),
        "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
