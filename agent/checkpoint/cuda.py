"""CUDA checkpoint of a process through the driver API (cuda-bindings), imported lazily."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.errors import SnapshotError

DEFAULT_LOCK_TIMEOUT_MS = 10_000

T = TypeVar("T")


@dataclass(frozen=True)
class Availability:
    """Whether CUDA checkpoint can be used here, and if not, why and what to do."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class CudaTimings:
    """Seconds spent in each driver call of a suspend or a resume."""

    first_s: float  # lock, or restore
    second_s: float  # checkpoint, or unlock


def uses_cuda(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether `pid` has an NVIDIA device open, i.e. a CUDA context to checkpoint."""
    fd_dir = proc_root / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fd_dir / name).startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class GpuPair:
    """Restore onto GPU `new` what was checkpointed on GPU `old` (NVML's "GPU-<uuid>")."""

    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.old} -> {self.new}"


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU UUID as NVML writes it ("GPU-3f2a...-..."), as CUuuid holds them."""
    raw = uuid.removeprefix("GPU-").replace("-", "")
    try:
        out = bytes.fromhex(raw)
    except ValueError:
        out = b""
    if len(out) != 16:
        raise SnapshotError(f"{uuid!r} is not a GPU UUID (GPU- and 32 hex digits, as "
                            "`nvidia-smi -L` shows)")
    return out


def gpu_pairs(snapshot_gpu: str | None, host_gpu: str | None) -> tuple[GpuPair, ...]:
    """The pairs a restore of a snapshot taken on `snapshot_gpu` needs on `host_gpu`: none
    when either is unknown (no GPU) or they are the same GPU."""
    if not snapshot_gpu or not host_gpu or snapshot_gpu == host_gpu:
        return ()
    return (GpuPair(snapshot_gpu, host_gpu),)


def _cu_uuid(cu: Any, uuid: str) -> Any:
    value = cu.CUuuid()
    value.bytes = uuid_bytes(uuid)
    return value


class CudaCheckpoint:
    """cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState} on other processes.

    Example::

        cc = CudaCheckpoint()
        if cc.available().ok:
            cc.suspend(pid)   # lock (with a timeout) + checkpoint: GPU memory to host
            ...               # criu dump
            cc.resume(pid)    # restore + unlock
    """

    def __init__(self, lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
                 driver: Any = None) -> None:
        # `driver`: cuda.bindings.driver, or a stand-in in unit tests; imported when needed.
        self._driver: Any = driver
        self.lock_timeout_ms = lock_timeout_ms

    def available(self) -> Availability:
        try:
            from cuda.bindings import driver
        except ImportError:
            return Availability(
                False, "cuda-bindings is not installed; pip install 'pitstop[cuda]' on GPU hosts"
            )
        if not hasattr(driver, "cuCheckpointProcessLock"):
            return Availability(
                False, "this cuda-bindings lacks cuCheckpointProcess*; install cuda-bindings>=12.8"
            )
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return Availability(False, f"cuInit failed ({err.name}): no NVIDIA GPU or driver here")
        self._driver = driver
        return Availability(True, "cuda-bindings driver API with cuCheckpointProcess*")

    def _cu(self) -> Any:
        if self._driver is None:
            a = self.available()
            if not a.ok:
                raise SnapshotError(f"CUDA checkpoint unavailable: {a.reason}")
        return self._driver

    def _check(self, result: Any, what: str, pid: int) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if err != self._cu().CUresult.CUDA_SUCCESS:
            raise SnapshotError(f"{what} of PID {pid} failed: {getattr(err, 'name', err)}")
        return result

    def state(self, pid: int) -> str:
        """running, locked, checkpointed or failed (the driver's CUprocessState)."""
        cu = self._cu()
        _, st = self._check(cu.cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState", pid)
        return st.name.removeprefix("CU_PROCESS_STATE_").lower()

    def suspend(self, pid: int) -> CudaTimings:
        """Lock (waits for running work, up to the timeout), then checkpoint to host memory."""
        cu = self._cu()
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = self.lock_timeout_ms
        t0 = time.monotonic()
        self._check(cu.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock", pid)
        t1 = time.monotonic()
        try:
            self._check(
                cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()),
                "cuCheckpointProcessCheckpoint",
                pid,
            )
        except SnapshotError as first:
            try:
                self._check(
                    cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()),
                    "cuCheckpointProcessUnlock (after a failed checkpoint)",
                    pid,
                )
            except SnapshotError as second:
                # Both matter: why the checkpoint failed, and that the process stays locked.
                raise SnapshotError(f"{first}\nand then {second}; PID {pid} stays locked: "
                                    "kill the engine and cold start") from first
            raise
        return CudaTimings(t1 - t0, time.monotonic() - t1)

    def _restore_args(self, gpu_pairs: tuple[GpuPair, ...]) -> Any:
        cu = self._cu()
        args = cu.CUcheckpointRestoreArgs()
        if gpu_pairs:
            pairs = []
            for p in gpu_pairs:
                pair = cu.CUcheckpointGpuPair()
                pair.oldUuid = _cu_uuid(cu, p.old)
                pair.newUuid = _cu_uuid(cu, p.new)
                pairs.append(pair)
            # The driver wants every GPU the process had: one engine process has one.
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        return args

    def restore(self, pid: int, gpu_pairs: tuple[GpuPair, ...] = ()) -> float:
        """Restore GPU memory from host memory and leave the process locked (its CUDA calls
        wait for the unlock); nothing to do unless it is checkpointed. Seconds taken.

        `gpu_pairs` moves the process from the GPU it was checkpointed on to another of the
        same chip (driver 580+); empty: back onto the same GPU."""
        cu = self._cu()
        t0 = time.monotonic()
        if self.state(pid) == "checkpointed":
            self._check(
                cu.cuCheckpointProcessRestore(pid, self._restore_args(gpu_pairs)),
                "cuCheckpointProcessRestore" + "".join(f" ({p})" for p in gpu_pairs),
                pid,
            )
        return time.monotonic() - t0

    def resume(self, pid: int, gpu_pairs: tuple[GpuPair, ...] = ()) -> CudaTimings:
        """Restore (unless that was done already: a standby woken ahead), then unlock: the
        process runs CUDA again."""
        restored = self.restore(pid, gpu_pairs)
        cu = self._cu()
        t1 = time.monotonic()
        self._check(
            cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()),
            "cuCheckpointProcessUnlock",
            pid,
        )
        return CudaTimings(restored, time.monotonic() - t1)

    def resume_all(self, pids: tuple[int, ...],
                   gpu_pairs: tuple[GpuPair, ...] = ()) -> dict[int, CudaTimings]:
        """`resume` of every PID of a tree at once. SnapshotError names each PID that
        failed; the others were resumed all the same."""
        return _each_at_once(lambda p: self.resume(p, gpu_pairs), pids)

    def restore_all(self, pids: tuple[int, ...],
                    gpu_pairs: tuple[GpuPair, ...] = ()) -> dict[int, float]:
        """`restore` of every PID of a tree at once, each left locked; errors as resume_all."""
        return _each_at_once(lambda p: self.restore(p, gpu_pairs), pids)


def _each_at_once(fn: Callable[[int], T], pids: tuple[int, ...]) -> dict[int, T]:
    """fn(pid) for every PID, one thread each. A restore call waits while the driver brings
    that process's device memory and context back; vLLM's API server and engine core are
    restored side by side instead of one after the other. The driver calls of
    cuda-bindings let go of the GIL."""
    if len(pids) <= 1:
        return {p: fn(p) for p in pids}
    with ThreadPoolExecutor(max_workers=len(pids), thread_name_prefix="cuda-restore") as pool:
        futures = {p: pool.submit(fn, p) for p in pids}
    done: dict[int, T] = {}
    failed: list[SnapshotError] = []
    for p, f in futures.items():
        try:
            done[p] = f.result()
        except SnapshotError as e:
            failed.append(e)
    if failed:
        raise SnapshotError("; ".join(map(str, failed))) from failed[0]
    return done
