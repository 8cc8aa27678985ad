"""Read what a snapshot depends on from the host: the identity a restore must match."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from importlib import metadata

from pydantic import BaseModel, ConfigDict

import agent

# Environment variables that change what the engine computes or where it runs;
# only these are recorded, so that unrelated variables do not make snapshots stale.
SELECTED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_USE_V1",
    "OMP_NUM_THREADS",
)


class Identity(BaseModel):
    """Everything a snapshot depends on; a restore needs every field equal.

    Example::

        ident = collect(engine_kind="reference", engine_version="0.1.0", criu="4.1.1")
        ident.kernel  # '6.18.0'
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    driver_version: str | None
    cuda_driver_version: str | None
    gpu_name: str | None
    gpu_uuid: str | None
    kernel: str
    engine_kind: str
    engine_version: str
    torch: str | None
    python: str
    criu: str | None
    weights_digest: str | None
    engine_args: tuple[str, ...]
    env: dict[str, str]
    pitstop_version: str


class _Gpu(BaseModel):
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    gpu_name: str | None = None
    gpu_uuid: str | None = None


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _gpu(index: int = 0) -> _Gpu:
    """NVML facts of GPU `index`, or all None on a host without a GPU or driver."""
    try:
        import pynvml
    except ImportError:
        return _Gpu()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return _Gpu()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return _Gpu(
            driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
            cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpu_name=_text(pynvml.nvmlDeviceGetName(handle)),
            gpu_uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        )
    except pynvml.NVMLError:
        return _Gpu()
    finally:
        pynvml.nvmlShutdown()


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def collect(
    *,
    engine_kind: str,
    engine_version: str,
    criu: str | None,
    engine_args: Sequence[str] = (),
    weights_digest: str | None = None,
    environ: Mapping[str, str] | None = None,
    gpu_index: int = 0,
) -> Identity:
    """The identity of this host and engine now. The caller passes the CRIU version it
    will use (agent.checkpoint.criu_locate), since this layer does not run CRIU."""
    env = os.environ if environ is None else environ
    return Identity(
        **_gpu(gpu_index).model_dump(),
        kernel=os.uname().release,
        engine_kind=engine_kind,
        engine_version=engine_version,
        torch=_package_version("torch"),
        python=platform.python_version(),
        criu=criu,
        weights_digest=weights_digest,
        engine_args=tuple(engine_args),
        env={k: env[k] for k in SELECTED_ENV if k in env},
        pitstop_version=agent.__version__,
    )
