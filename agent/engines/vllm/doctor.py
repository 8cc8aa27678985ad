"""`pitstop doctor` for vLLM: which of its recovery paths can work on this host, and why not."""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Callable

from agent.checkpoint.criu_locate import locate
from agent.checks import Check
from agent.config import Config
from agent.engines.vllm.adapter import BASE_ENV, plugin_refusal
from agent.engines.vllm.cli import (
    FLASHINFER_SAMPLER,
    VllmFeatures,
    gpu_present,
    host_unfit,
    read_features,
    sampler_off,
)
from agent.engines.vllm.plugin import support
from agent.engines.vllm.preload import PreloadLink, engine_gpu
from agent.engines.vllm.snapshot import choose_backend
from agent.errors import EngineError, SnapshotError
from agent.refusal import RefusalCode


def kernel_hides_passcred() -> bool:
    """Whether this kernel answers SO_PASSCRED on a TCP socket with EOPNOTSUPP (Linux >= 6.16
    restricted it to Unix, netlink and Bluetooth sockets): what breaks CRIU 4.1's dumps."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED)
        except OSError as e:
            return e.errno == errno.EOPNOTSUPP
    return False


def criu_can_dump_tcp(config: Config) -> tuple[bool, str]:
    """Whether the CRIU Pitstop would use can dump vLLM's TCP sockets: CRIU >= 4.2 can on
    every kernel; 4.1 asks every socket for SO_PASSCRED and fails where the kernel refuses
    it on TCP ("sockets: Can't get 1:16 opt", CRIU issue 2705)."""
    try:
        binary = locate(config.snapshots.criu)
    except SnapshotError as e:
        hides = " (this kernel refuses SO_PASSCRED on TCP sockets)" \
            if kernel_hides_passcred() else ""
        return False, f"{e}{hides}"
    return True, f"CRIU {binary.version} dumps the TCP sockets of vLLM's tree"


def vllm_checks(
    config: Config,
    *,
    features: Callable[[], VllmFeatures] | None = None,
    has_gpu: Callable[[], bool] | None = None,
    tcp_dump: Callable[[Config], tuple[bool, str]] = criu_can_dump_tcp,
    preload_link: PreloadLink | None = None,
) -> list[Check]:
    """The vLLM items of `pitstop doctor`: the installed vLLM, and each recovery path beyond a
    cold start (Pitstop's CRIU backend, `vllm snapshot`, `vllm preload`).

    Example::

        for c in vllm_checks(load_config(path)):
            print(c.name, c.ok, c.detail)
    """
    python = str(config.engine.python) if config.engine.python else sys.executable
    # As the engine will run: its interpreter, vLLM's base environment, engine.env.
    env = {**os.environ, **BASE_ENV, **config.engine.env}
    if features is None:
        def features() -> VllmFeatures:
            return read_features(python, env)
    if has_gpu is None:
        def has_gpu() -> bool:
            return gpu_present(env)
    try:
        f = features()
    except EngineError as e:
        return [Check("vllm", False, True, str(e), "point engine.python at vLLM's virtualenv")]
    if f.distribution is None:
        return [Check("vllm", False, True, f"no vLLM installed for {python}",
                      "install vLLM there (make vllm on CPU) or set engine.python")]
    gpu = has_gpu()
    checks = [Check("vllm", True, True, f"{f.describe()} ({python})")]
    if f.cuda_build and f.flashinfer is False and not sampler_off(env):
        checks.append(Check(
            "vllm sampler", False, True,
            f"{f.describe()} has no `flashinfer` module, which its default top-k/top-p "
            f"sampler imports on CUDA: the engine core fails at start (No module named "
            f"'flashinfer')",
            f"pip install flashinfer-python into {python}'s environment (vLLM's CUDA "
            f"requirements name it), or set {FLASHINFER_SAMPLER}: \"0\" in engine.env"))
    backend, why = choose_backend(config, lambda: f, lambda: gpu)
    return [*checks, _criu_check(config, backend, tcp_dump),
            _snapshot_check(config, f, gpu, backend, why), _plugin_check(config, f, python),
            _preload_check(config, f, gpu, preload_link)]


def _criu_check(config: Config, backend: str,
                tcp_dump: Callable[[Config], tuple[bool, str]]) -> Check:
    """Whether Pitstop's CRIU backend can snapshot vLLM here."""
    dumpable, how = tcp_dump(config)
    needed = config.snapshots.enabled and backend == "pitstop"
    if dumpable:
        return Check("criu of vLLM", True, needed,
                     f"{how}; needs kernel.io_uring_disabled=2 as well (see io_uring)")
    return Check("criu of vLLM", False, needed,
                 f"Pitstop's CRIU backend cannot snapshot vLLM with this CRIU: {how}",
                 "run `make criu` (or the criu role) for CRIU >= 4.2; until then every vLLM "
                 "start is cold")


def _snapshot_check(config: Config, f: VllmFeatures, gpu: bool, backend: str,
                    why: str) -> Check:
    """Whether `vllm snapshot` can run here and is configured."""
    unfit = host_unfit(f, gpu, "snapshot")
    configured = config.vllm.snapshot.model is not None and config.vllm.snapshot.revision
    name = "vllm snapshot"
    needed = config.snapshots.enabled and config.snapshots.backend == "vllm"
    present = "present" if f.snapshot else "absent"
    if unfit is not None:
        return Check(name, False, needed, f"{present}, but cannot run: {unfit}; "
                     f"snapshots use the {backend} backend",
                     "a CUDA build of vLLM on an NVIDIA GPU host" if f.snapshot else
                     "install a vLLM that has `vllm snapshot` (0.32+)")
    if not configured:
        return Check(name, False, needed, "usable here, but vllm.snapshot.model and "
                     f"vllm.snapshot.revision are not set; backend {backend} ({why})",
                     "set them (a Hugging Face repo id and its 40-character commit)")
    return Check(name, True, needed, f"usable; backend {backend} ({why})")


def _plugin_check(config: Config, f: VllmFeatures, python: str) -> Check:
    """Whether Pitstop's plugin lets vLLM map held weights (the hybrid and warm rungs)."""
    refusal = plugin_refusal(f, python, support.Untested(config.vllm.plugin.untested))
    held = config.holder.enabled
    if refusal is None:
        return Check("vllm plugin", True, held, f"Pitstop plugin {f.plugin}: the hybrid "
                     "and warm rungs map held weights" + ("" if held else
                                                        " (holder.enabled is false)"))
    return Check("vllm plugin", False, held,
                 f"no hybrid or warm rung for vLLM: {refusal.detail}",
                 f"scripts/install-vllm-plugin.sh {python}"
                 if refusal.code is RefusalCode.PLUGIN_NOT_INSTALLED else None)


def _preload_check(config: Config, f: VllmFeatures, gpu: bool,
                   preload_link: PreloadLink | None) -> Check:
    """Whether `vllm preload` can run here and, when it is on, its daemon answers."""
    pre = config.vllm.preload
    unfit = host_unfit(f, gpu, "preload")
    present = "present" if f.preload else "absent"
    if unfit is not None:
        return Check("vllm preload", False, pre.enabled, f"{present}, but cannot run: "
                     f"{unfit}" + ("" if pre.enabled else " (vllm.preload is off)"),
                     "a CUDA build of vLLM on an NVIDIA GPU host" if f.preload else
                     "install a vLLM that has `vllm preload` (0.32+)")
    if not pre.enabled:
        return Check("vllm preload", True, False, "usable here; off (vllm.preload.enabled: false)")
    link = preload_link or PreloadLink(config, gpu=lambda: engine_gpu(config))
    reason = link.unavailable()
    gpu_name = engine_gpu(config) or "?"
    return Check("vllm preload", reason is None, True,
                 reason.detail if reason is not None
                 else f"the daemon for GPU {gpu_name} is healthy",
                 None if reason is None else
                 f"systemctl enable --now pitstop-vllm-preload@{gpu_name}.service")
