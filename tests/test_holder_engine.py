"""The reference engine as a holder tenant: warm start from held weights, prepare/resume."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

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
    return Path(f"/proc/{pid}/maps").read_text().count("memfd:pitstop:")


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
        assert held_maps(e.proc.pid) == 0  # nothing of the held memory is mapped now
        code, body = post(e, "/pitstop/resume")
        assert code == 200 and body["held"]["attached"] is True
        assert held_maps(e.proc.pid) == 1
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
