"""The hybrid path on CPU with real CRIU: the engine's image leaves the held weights out."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import proc
from agent.checkpoint.criu import CriuBackend, DumpOptions
from agent.checkpoint.snapshotter import Snapshotter
from agent.identity import collect
from agent.store import Canary, SnapshotStore
from tests.holder_proc import Holder
from tests.refengine_proc import REPO, Engine
from tests.snapshot_helpers import capture as take_snapshot
from tests.snapshot_helpers import criu, kill_and_reap, subreaper  # noqa: F401 - autouse
from tests.test_holder_engine import PROMPT, complete, held_maps, post, state

pytestmark = pytest.mark.integration

WEIGHTS_GIB = 1 / 16  # 64 MiB of bf16 weights: big enough to see in an image's size


@pytest.fixture(scope="module")
def model() -> Path:
    from agent.modelgen import make_model, record_for, spec_for

    spec = spec_for(target_gib=WEIGHTS_GIB)
    key = hashlib.sha256(json.dumps(record_for(spec), sort_keys=True).encode()).hexdigest()[:16]
    directory = REPO / ".cache" / "models" / f"held-{key}"
    make_model(directory, spec)
    return directory


class SupervisedEngine(Engine):
    """The engine started as the supervisor starts it (own session, stdin /dev/null,
    output one pipe to us), so CRIU can dump it."""

    def __init__(self, model: Path, sock: Path, *extra: str) -> None:
        argv = [sys.executable, "-m", "agent.engines.refengine", "--model", str(model),
                "--uds", str(sock), "--served-model-name", "held", "--device", "cpu",
                "--kv-slots", "2", "--max-model-len", "256", *extra]
        with proc.spawn_lock():
            p = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            proc.own(p.pid)
        super().__init__(p, sock, "held", sock.with_suffix(".log"))
        deadline = time.monotonic() + 120
        while not self._healthy():
            if p.poll() is not None or time.monotonic() > deadline:
                out = p.stdout.read().decode(errors="replace") if p.poll() is not None else ""
                self.stop()
                raise AssertionError(f"engine did not come up:\n{out}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        with contextlib.suppress(Exception), self.http(timeout=2) as c:
            return c.get("/health").status_code == 200
        return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        proc.disown(self.proc.pid)
        if self.proc.stdout:
            self.proc.stdout.close()


def capture(snap: Snapshotter, e: SupervisedEngine, answer: str, kind: str,
            leave_running: bool = False):
    info = take_snapshot(
        snap, e.proc.pid, canary=Canary(prompt=PROMPT, max_tokens=8, text=answer, token_ids=()),
        identity=collect(engine_kind="reference", engine_version="1", criu=snap.criu.version),
        kind=kind, options=DumpOptions(leave_running=leave_running))  # type: ignore[arg-type]
    if not leave_running:
        e.stop()  # reap what CRIU killed, so the PID is free for the restore
    return info


@contextlib.contextmanager
def restored(snap: Snapshotter, manifest, sock: Path) -> Iterator[tuple[Engine, int]]:
    r = snap.restore(manifest)
    try:
        yield Engine(None, sock, "held", sock.with_suffix(".log")), r.pid  # type: ignore
    finally:
        kill_and_reap(r.pid)
        for f in set(r.outputs.values()):
            f.close()


def test_hybrid_snapshot_restore_resume_and_the_image_is_much_smaller(holder: Holder, model,
                                                                      tmp_path: Path):
    snap = Snapshotter(SnapshotStore(tmp_path / "snaps"), CriuBackend(criu()), None,
                       log_dir=tmp_path / "logs")
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))

    sock = tmp_path / "hyb.sock"
    e = SupervisedEngine(model, sock, "--holder", str(holder.sock), "--weights-digest",
                         "sha256-hybrid")
    try:
        answer = complete(e)
        # What a checkpoint without the holder protocol carries: the weights, mapped.
        # (An engine that loaded from disk maps its weights from the files on CPU, and
        # CRIU leaves such file pages out; on a GPU they are device memory, in the image.)
        full = capture(snap, e, answer, "full", leave_running=True)
        code, body = post(e, "/pitstop/prepare")
        assert code == 200 and not body["held"]["attached"], body
        hybrid = capture(snap, e, answer, "hybrid")
    finally:
        e.stop()
    print(f"image bytes: with weights mapped {full.image_bytes}, hybrid {hybrid.image_bytes}, "
          f"weights {weights}")
    # The held weights stay out of the image: it is smaller by about their size.
    assert hybrid.image_bytes < full.image_bytes - weights * 0.8, (hybrid.image_bytes,
                                                                   full.image_bytes, weights)

    with restored(snap, hybrid.manifest, sock) as (r, pid):
        assert held_maps(pid) == 0
        assert state(r)["paused"]  # restored as it was dumped: prepared
        code, body = post(r, "/pitstop/resume")
        assert code == 200 and body["held"]["attached"], body
        assert held_maps(pid) == 1
        assert complete(r) == answer  # the canary, through weights the image never had

    # The holder restarted (GPU reset, reboot): the memory the image expects is gone.
    assert holder.stop() == 0
    fresh = Holder(holder.base)
    try:
        with restored(snap, hybrid.manifest, sock) as (r, _):
            code, body = post(r, "/pitstop/resume")
            assert code == 409 and "cannot be re-attached" in body["error"]["message"]
    finally:
        assert fresh.stop() == 0
    holder.proc = fresh.proc  # the fixture's stop() finds it already stopped
