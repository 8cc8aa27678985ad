"""Kept KV through the real agent, front and reference engine: a stream cut by SIGKILL
after a long prompt continues from the dead engine's KV, or is prefilled again when the
ledger or the KV cannot be trusted, with the same text either way."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.holder.kvledger import HEADER_BYTES, LedgerShape
from tests.agentproc import RunningAgent, held_agent
from tests.conftest import cached_model
from tests.holder_proc import Holder
from tests.snapshot_helpers import criu_present  # noqa: F401 - autouse: CRIU is required

pytestmark = pytest.mark.integration

# Long enough that prefilling it again is most of a resume's work on the tiny model.
PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
MAX_TOKENS = 120
CUT_AFTER = 20  # events the client gets before the engine is killed
SLOTS, MAX_LEN = 8, 2048  # the engine's defaults, which the ledger is laid out by


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[tuple[RunningAgent, Holder]]:
    """An agent whose engine keeps its weights and KV in a cpu holder, snapshot taken."""
    with held_agent(tmp_path, cached_model()) as agent_and_holder:
        yield agent_and_holder


def body(agent: RunningAgent, stream: bool) -> bytes:
    return json.dumps({"model": agent.status_model(), "prompt": PROMPT, "stream": stream,
                       "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()


def uninterrupted(agent: RunningAgent) -> str:
    req = urllib.request.Request(agent.front_url + "/completions", data=body(agent, False),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def stream_cut_by_sigkill(agent: RunningAgent, while_dead: Callable[[], None]) -> str:
    """Stream the request; after CUT_AFTER events SIGKILL the engine, with the agent
    stopped until `while_dead` has run (so it sees the dead engine's memory as it was
    left); return the text the client got in all."""
    req = urllib.request.Request(agent.front_url + "/completions", data=body(agent, True),
                                 headers={"content-type": "application/json"})
    text, events = "", 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            events += 1
            if events == CUT_AFTER:
                engine = agent.status()["engine_pid"]
                os.kill(agent.proc.pid, signal.SIGSTOP)
                try:
                    os.kill(engine, signal.SIGKILL)
                    while_dead()
                finally:
                    os.kill(agent.proc.pid, signal.SIGCONT)
    assert events > CUT_AFTER, "the answer ended before the engine could be killed"
    return text


def held_memfd(holder: Holder, suffix: str) -> Path:
    """The holder's fd of a KV region, to write into it as a fault (or a bug) would."""
    d = Path(f"/proc/{holder.proc.pid}/fd")
    [fd] = [e for e in d.iterdir() if f"/{suffix} (deleted)" in os.readlink(e)]
    return fd


def kv_resumes(agent: RunningAgent, outcome: str) -> float:
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'^pitstop_front_kv_resumes_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    assert m, f"no kv resume series for {outcome}"
    return float(m.group(1))


def test_a_stream_cut_after_a_long_prompt_continues_from_the_kept_kv(kept):
    a, _ = kept
    want = uninterrupted(a)
    restarts = a.status()["restarts"]
    got = stream_cut_by_sigkill(a, lambda: None)
    a.wait_recovered(restarts + 1)
    assert got == want
    log = a.logged("resume: kept KV for ")
    [line] = re.findall(r"resume: kept KV for (\d+) of (\d+) positions; prefilling (\d+)", log)
    kept_positions, positions, prefilled = map(int, line)
    # Only the last token ran again: the prompt and the tokens sent were not prefilled.
    assert prefilled == 1 and kept_positions == positions - 1 > 500
    assert a.status()["last_recovery"]["path"] == "hybrid"
    assert kv_resumes(a, "kept") == 1


def test_a_torn_ledger_falls_back_to_a_full_prefill_with_the_same_text(kept):
    a, holder = kept
    want = uninterrupted(a)
    shape = LedgerShape(entries=SLOTS, max_tokens=MAX_LEN, max_blocks=1)

    def tear_every_header() -> None:
        with held_memfd(holder, "ledger").open("r+b") as f:
            for entry in range(SLOTS):
                for copy in (0, 1):
                    f.seek(entry * shape.entry_bytes + copy * HEADER_BYTES + 40)
                    f.write(b"\xa5" * 8)  # inside the request key: the CRC no longer holds

    restarts = a.status()["restarts"]
    got = stream_cut_by_sigkill(a, tear_every_header)
    a.wait_recovered(restarts + 1)
    assert got == want
    a.logged("resume: kept KV not used (torn: ")
    assert kv_resumes(a, "torn") == 1


def test_overwritten_kv_blocks_fall_back_to_a_full_prefill_with_the_same_text(kept):
    a, holder = kept
    want = uninterrupted(a)

    def overwrite_layer0_keys() -> None:
        # Layer 0's K of every slot comes first in the pool: (layers, 2, slots, ...).
        with held_memfd(holder, "pool").open("r+b") as f:
            f.write(b"\x3f" * (4 << 20))

    restarts = a.status()["restarts"]
    got = stream_cut_by_sigkill(a, overwrite_layer0_keys)
    a.wait_recovered(restarts + 1)
    assert got == want
    a.logged("resume: kept KV not used (kv_changed: positions 0..15 changed")
    assert kv_resumes(a, "kv_changed") == 1
