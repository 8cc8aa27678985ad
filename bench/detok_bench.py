"""What text costs per token: the reference engine's detokenizer, and the front's tracker.

    .venv/bin/python bench/detok_bench.py [--runs 5] [--tokens 16,256,1024] [--out DIR]

Measures, on the tiny model's tokenizer (`pitstop make-model`, made when absent):
- `Detokenizer` (tokenizers' DecodeStream, as vLLM) over greedy-looking answers of N tokens,
  next to what the reference engine did before it: decode all the answer's ids at every
  token (quadratic in the answer's length);
- the front's `Tracker.feed` per SSE event, for events with text and for events of tokens
  that end inside a character (their ids wait for the text).
Each figure is the seconds for one whole answer or stream, over --runs runs. Writes
<date>-detok-cpu.json (a `rows` list) to --out (default bench/results/), never over an
existing file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.engines.refengine.detok import Detokenizer  # noqa: E402
from agent.engines.refengine.tokenizer import Tokenizer  # noqa: E402
from agent.front.resume import Plan, Tracker  # noqa: E402
from agent.modelgen import make_model, spec_for  # noqa: E402


def answer(tok: Tokenizer, n: int, seed: int) -> list[int]:
    """n ids of text with multi-byte characters, as a random model might generate them."""
    rng = random.Random(seed)
    words = ["engine", "café", "naïve", "5 €", "river", "😀", "door", "—", "bread", "ran"]
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" " + rng.choice(words), add_special_tokens=False)
    return ids[:n]


def new_detok(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    d = Detokenizer(tok.backend, prompt)
    return "".join(d.add(i).text for i in ids) + d.finish()


def full_decode_per_token(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    # The reference engine before DecodeStream: decode every id so far, at every token.
    sent = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if not text.endswith("\ufffd"):
            sent = text
    return sent


def sse_events(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[bytes]:
    d = Detokenizer(tok.backend, prompt)
    out = []
    for k, i in enumerate(ids):
        delta = d.add(i)
        choice: dict[str, Any] = {"index": 0, "text": delta.text, "logprobs": None,
                                  "finish_reason": "length" if k == len(ids) - 1 else None,
                                  "stop_reason": None, "token_ids": [i]}
        if k == 0:
            choice["prompt_token_ids"] = prompt
        obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
               "choices": [choice]}
        out.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


def track(events: list[bytes]) -> int:
    t = Tracker(Plan.of("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True,
                                            "max_tokens": len(events)}))
    t.begin_attempt()
    for ev in events:
        t.feed(ev)
    return len(t.out_ids)


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", default="16,256,1024")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    model = REPO / ".cache" / "models" / "bench-tiny"
    make_model(model, spec_for("tiny"))
    tok = Tokenizer(model)
    prompt = tok.encode("The engine ran")
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, " \
              f"Python {platform.python_version()}"
    command = "python bench/detok_bench.py " + shlex.join(sys.argv[1:])
    gib = sum(f.stat().st_size for f in model.iterdir()) / 2**30
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        ids = answer(tok, n, seed=n)
        assert new_detok(tok, prompt, ids) == full_decode_per_token(tok, prompt, ids)
        events = sse_events(tok, prompt, ids)
        waiting = sum(1 for ev in events if b'"text": ""' in ev)
        for engine, path, fn, arg in [
                ("refengine", f"detokenize {n} tokens: DecodeStream",
                 lambda x: new_detok(tok, prompt, x), ids),
                ("refengine", f"detokenize {n} tokens: full decode per token (before)",
                 lambda x: full_decode_per_token(tok, prompt, x), ids),
                ("front", f"track {n} events ({waiting} inside a character)", track, events)]:
            runs = timed(lambda f=fn, a=arg: f(a), args.runs)
            rows.append({"engine": engine, "path": path, "gib": round(gib, 4),
                         "runs_s": [round(r, 6) for r in runs],
                         "median_s": round(statistics.median(runs), 6),
                         "machine": machine, "command": command})
            print(f"{path:60s} median {statistics.median(runs) * 1e3:9.3f} ms "
                  f"({statistics.median(runs) / n * 1e6:7.2f} us/token)")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}-detok-cpu"
    path, k = args.out / f"{stem}.json", 2
    while path.exists():
        path, k = args.out / f"{stem}-{k}.json", k + 1
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
