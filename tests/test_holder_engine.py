"""The reference engine as a holder tenant: warm start from held weights, prepare/resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest

from agent.holder import protocol as p
from agent.holder.kvledger import (
    KV_HEADER,
    KV_KEPT_HEADER,
    REQUEST_HEADER,
    RESUME_HEADER,
    KeptKVOutcome,
)
from tests.holder_proc import Holder
from tests.refengine_proc import Engine, run_engine

pytestmark = pytest.mark.integration

PROMPT = "Pitstop canary: the quick brown fox"


def complete(e: Engine) -> str:
    with e.http() as c:
        r = c.post("/v1/completions", json={"model": e.name, "prompt": PROMPT,
                                              "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


def state(e: Engine) -> dict:
    with e.http() as c:
        return c.get("/pitstop/state").json()


def post(e: Engine, path: str) -> tuple[int, dict]:
    with e.http() as c:
        r = c.post(path, json={})
        return r.status_code, r.json()


def zero_tensor_bytes(path: Path) -> None:
    """Keep the safetensors header, zero every tensor byte: what is read from disk now
    can no longer give the model's answers."""
    with path.open("r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        size = path.stat().st_size - 8 - n
        f.write(b"\0" * size)


def held_maps(pid: int) -> int:
    """Mappings of held weights (the KV pool and its ledger, also held, not counted)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return maps.count("memfd:pitstop:") - kv_maps(pid)


def kv_maps(pid: int) -> int:
    return Path(f"/proc/{pid}/maps").read_text().count("memfd:pitstop:kv/")


@pytest.fixture
def model(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy: the warm-start test spoils its weights on disk."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    return d


def test_a_warm_start_attaches_held_weights_and_reads_none_from_disk(holder: Holder, model):
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-warm")
    with run_engine(model, *args) as e:
        assert state(e)["weights_source"] == "disk"
        answer = complete(e)
    with holder.client() as c:
        assert c.has_committed("sha256-warm")  # outlived the engine
    zero_tensor_bytes(model / "model.safetensors")
    with run_engine(model, *args) as e:
        st = state(e)
        assert st["weights_source"] == "holder"
        assert held_maps(e.proc.pid) == 1
        # The disk holds zeros now: the right answer can only come from held memory.
        assert complete(e) == answer
    # Another digest never reuses those regions: the (zeroed) files are loaded anew.
    with run_engine(model, "--holder", str(holder.sock), "--weights-digest", "sha256-zeroed"
                    ) as e:
        assert state(e)["weights_source"] == "disk"
        assert complete(e) != answer
    with holder.client() as c:
        assert c.has_committed("sha256-warm") and c.has_committed("sha256-zeroed")


def test_prepare_detaches_held_weights_and_resume_brings_them_back(holder: Holder, model):
    with run_engine(model, "--holder", str(holder.sock), "--weights-digest", "sha256-pr") as e:
        answer = complete(e)
        assert held_maps(e.proc.pid) == 1
        code, body = post(e, "/pitstop/prepare")
        assert code == 200 and body["held"]["attached"] is False and body["paused"]
        # Nothing of the held memory is mapped now, KV pool and ledger included.
        assert held_maps(e.proc.pid) == 0 and kv_maps(e.proc.pid) == 0
        code, body = post(e, "/pitstop/resume")
        assert code == 200 and body["held"]["attached"] is True
        assert held_maps(e.proc.pid) == 1 and kv_maps(e.proc.pid) == 2
        assert complete(e) == answer


def test_resume_refuses_when_the_held_weights_are_gone(holder: Holder, model):
    with run_engine(model, "--holder", str(holder.sock), "--weights-digest", "sha256-gone") as e:
        assert post(e, "/pitstop/prepare")[0] == 200
        with holder.client() as c:
            for r in c.list():
                c.release(r.name)
        code, body = post(e, "/pitstop/resume")
        assert code == 409 and "cannot be re-attached" in body["error"]["message"]
        assert state(e)["paused"]  # it does not serve without its weights
        assert held_maps(e.proc.pid) == 0


def test_the_engine_without_a_holder_reports_disk(model):
    with run_engine(model) as e:
        st = state(e)
        assert st["weights_source"] == "disk" and st["held"] is None


def test_without_a_digest_the_engine_names_regions_by_the_agents_digest(holder: Holder, model):
    from agent.weights import WeightsDigester

    want = WeightsDigester(None).digest(model).digest
    with run_engine(model, "--holder", str(holder.sock)) as e:
        assert state(e)["held"]["digest"] == want
    with holder.client() as c:
        assert c.has_committed(want)
        assert [r.name for r in c.list(want)] == [f"{want}/model.safetensors"]


LONG = " ".join(f"item {i} of the list" for i in range(40))


def stream_ids(e: Engine, prompt: str | list[int], max_tokens: int,
               headers: dict[str, str], stop_after: int | None = None
               ) -> tuple[list[int], list[int], dict[str, str]]:
    """(prompt ids, generated ids, response headers) of a greedy stream; with
    `stop_after`, the engine is SIGKILLed once that many ids came."""
    body = {"model": e.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    prompt_ids: list[int] = []
    ids: list[int] = []
    with e.http() as c, c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            prompt_ids = choice.get("prompt_token_ids") or prompt_ids
            ids += choice["token_ids"]
            if stop_after is not None and len(ids) >= stop_after:
                os.kill(e.proc.pid, signal.SIGKILL)
                break
        return prompt_ids, ids, dict(r.headers)


def test_a_gpu_faults_drop_leaves_no_kept_kv_and_the_resume_is_prefilled(holder: Holder, model):
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-fault")
    with run_engine(model, *args) as e:
        prompt, want, _ = stream_ids(e, LONG, 40, {})
        _, got, _ = stream_ids(e, LONG, 40, {REQUEST_HEADER: "r1"}, stop_after=10)
    with holder.client() as c:
        c.drop(p.DropReason.GPU_FAULT, "test: an Xid")  # what the agent does after a fault
    with run_engine(model, *args) as e:
        _, rest, headers = stream_ids(e, prompt + got, 40 - len(got),
                                      {REQUEST_HEADER: "r1", RESUME_HEADER: str(len(got))})
        assert headers[KV_HEADER.lower()] == KeptKVOutcome.NO_ENTRY
        assert got + rest == want
        assert state(e)["kv_resumes"] == {"no_entry": 1}


def test_a_second_engine_on_the_same_holder_keeps_its_kv_privately(holder: Holder, model):
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-two")
    with run_engine(model, *args) as first:
        assert state(first)["kv_held"] and kv_maps(first.proc.pid) == 2
        with run_engine(model, *args, name="second") as second:
            assert not state(second)["kv_held"]
            assert "kept KV off: the holder cannot hold the KV pool" in second.log_text()
            assert "is claimed by pid" in second.log_text()
            assert complete(second) == complete(first)


def test_engines_of_two_owners_on_the_same_holder_each_keep_their_kv_there(holder: Holder,
                                                                              model):
    """Two agents' engines on one holder (a node of several engines): each its own pool."""
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-owners")

    def pools() -> set[str]:
        with holder.client() as c:
            return {r.name for r in c.list() if r.name.endswith("/pool")}

    before = pools()
    with run_engine(model, *args, "--kv-owner", "/run/pitstop/engines/a/engine.sock") as a, \
            run_engine(model, *args, "--kv-owner", "/run/pitstop/engines/b/engine.sock",
                       name="second") as b:
        assert state(a)["kv_held"] and state(b)["kv_held"]
        assert "kept KV off" not in b.log_text()
        assert complete(a) == complete(b)
        assert len(pools() - before) == 2


def test_without_keep_kv_a_resume_is_prefilled_and_says_why(holder: Holder, model):
    with run_engine(model, "--holder", str(holder.sock), "--weights-digest", "sha256-nokv",
                    "--no-keep-kv") as e:
        assert not state(e)["kv_held"] and kv_maps(e.proc.pid) == 0
        prompt, ids, _ = stream_ids(e, LONG, 4, {})
        _, _, headers = stream_ids(e, prompt + ids[:2], 2,
                                   {REQUEST_HEADER: "x", RESUME_HEADER: "2"})
        assert headers[KV_HEADER.lower()] == KeptKVOutcome.NOT_HELD


def test_finished_requests_leave_nothing_in_the_ledger(holder: Holder, model):
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-done")
    with run_engine(model, *args) as e:
        prompt, ids, _ = stream_ids(e, LONG, 6, {REQUEST_HEADER: "done"})
    with run_engine(model, *args) as e:
        assert state(e)["kv_orphans"] == 0  # the engine freed its entry when it finished
        _, _, headers = stream_ids(e, prompt + ids[:3], 3,
                                   {REQUEST_HEADER: "done", RESUME_HEADER: "3"})
        assert headers[KV_HEADER.lower()] == KeptKVOutcome.NO_ENTRY


def test_a_dead_engines_entry_gives_way_when_its_slot_is_needed(holder: Holder, model):
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-full", "--kv-slots", "1")
    with run_engine(model, *args) as e:
        prompt, got, _ = stream_ids(e, LONG, 40, {REQUEST_HEADER: "old"}, stop_after=5)
    with run_engine(model, *args) as e:
        assert state(e)["kv_orphans"] == 1
        # The pool is bounded: a new request takes the only slot, kept KV or not.
        assert complete(e)
        assert state(e)["kv_orphans"] == 0
        _, _, headers = stream_ids(e, prompt + got, 5,
                                   {REQUEST_HEADER: "old", RESUME_HEADER: str(len(got))})
        assert headers[KV_HEADER.lower()] == KeptKVOutcome.NO_ENTRY


def test_a_warm_start_continues_a_killed_stream_from_the_kept_kv(holder: Holder, model):
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-kept")
    with run_engine(model, *args) as e:
        prompt, want, _ = stream_ids(e, LONG, 40, {})
        _, got, _ = stream_ids(e, LONG, 40, {REQUEST_HEADER: "r1"}, stop_after=10)
    with run_engine(model, *args) as e:
        assert state(e)["kv_orphans"] == 1
        context = prompt + got
        _, rest, headers = stream_ids(e, context, 40 - len(got),
                                      {REQUEST_HEADER: "r1", RESUME_HEADER: str(len(got))})
        assert headers[KV_HEADER.lower()] == KeptKVOutcome.KEPT
        assert int(headers[KV_KEPT_HEADER.lower()]) == len(context) - 1
        assert got + rest == want
        assert state(e)["prefill_tokens"] == 1  # the last token only; the rest was kept


def test_a_request_that_took_a_dead_engines_slot_is_kept_through_the_next_canary(
        holder: Holder, model):
    # Every slot holds an entry of a dead engine, so a new request takes one over; it is
    # killed in turn. After every recovery the supervisor's canary (a new request) comes
    # before the client's resume, with no slot free again: it must take the oldest entry,
    # not the one just killed.
    args = ("--holder", str(holder.sock), "--weights-digest", "sha256-takeover",
            "--kv-slots", "2")
    with run_engine(model, *args) as e:
        prompt, want, _ = stream_ids(e, LONG, 40, {})
        stream_ids(e, LONG, 40, {REQUEST_HEADER: "a"}, stop_after=5)
    with run_engine(model, *args) as e:
        stream_ids(e, LONG, 40, {REQUEST_HEADER: "b"}, stop_after=5)
    with run_engine(model, *args) as e:
        assert state(e)["kv_orphans"] == 2
        _, got, _ = stream_ids(e, LONG, 40, {REQUEST_HEADER: "new"}, stop_after=10)
    with run_engine(model, *args) as e:
        assert state(e)["kv_orphans"] == 2
        assert complete(e)  # the canary
        context = prompt + got
        _, rest, headers = stream_ids(e, context, 40 - len(got),
                                      {REQUEST_HEADER: "new", RESUME_HEADER: str(len(got))})
        assert headers[KV_HEADER.lower()] == KeptKVOutcome.KEPT
        assert int(headers[KV_KEPT_HEADER.lower()]) == len(context) - 1
        assert got + rest == want
