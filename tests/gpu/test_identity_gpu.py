"""Identity on a real GPU host: NVML's driver, CUDA version, UUID and memory, as nvidia-smi
reports them. Run on the device machine: `pytest -m gpu tests/gpu -s` (prints the identity)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agent.config import parse_config
from agent.engines import build_adapter
from agent.errors import SourceUnavailable
from agent.identity import host_identity, read_cuda_checkpoint, read_gpu

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    # Skipped, not failed, without a GPU even under CI=true: CI has none by design, and
    # the `gpu` marker keeps these out of `make test` anyway.
    try:
        return read_gpu(0)
    except SourceUnavailable as e:
        pytest.skip(f"no NVIDIA GPU here: {e}")


def smi(query: str) -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi is not installed; nothing to compare NVML with")
    out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [c.strip() for c in out.splitlines()[0].split(",")]


def test_nvml_fields_match_nvidia_smi(gpu):
    driver, uuid, name, mem_mib = smi("driver_version,uuid,name,memory.total")
    assert gpu.driver_version == driver
    assert gpu.gpu_uuid == uuid and re.match(r"^GPU-[0-9a-f-]{36}$", uuid)
    assert gpu.gpu_name == name
    assert abs(gpu.gpu_memory_bytes - int(mem_mib) * 2**20) < 2**30
    assert re.match(r"^\d+\.\d$", gpu.cuda_driver_version)
    # The same GPU when CUDA_VISIBLE_DEVICES names it by UUID.
    assert read_gpu(gpu.gpu_uuid) == gpu


def test_host_identity_on_the_gpu_host_and_its_cost(gpu, tmp_path: Path):
    cfg = parse_config({"engine": {"model": str(tmp_path), "device": "cuda"}}, "gpu test")
    adapter = build_adapter(cfg)
    host_identity(cfg, adapter, None, None)  # the engine interpreter probe, once
    t0 = time.perf_counter()
    ident = host_identity(cfg, adapter, None, None)
    cached_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    read_gpu(0)
    nvml_s = time.perf_counter() - t0
    assert (ident.driver_version, ident.gpu_uuid, ident.gpu_memory_bytes) == (
        gpu.driver_version, gpu.gpu_uuid, gpu.gpu_memory_bytes)
    try:
        mechanism = read_cuda_checkpoint()
    except SourceUnavailable:
        mechanism = None
    assert ident.cuda_checkpoint == mechanism
    print(f"\nidentity on this GPU host:\n{ident.model_dump_json(indent=1)}")
    print(f"read_gpu (NVML init + queries + shutdown): {nvml_s * 1e3:.1f} ms; "
          f"host_identity with the probe cached: {cached_s * 1e3:.1f} ms")
