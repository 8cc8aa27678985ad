"""The engine's GPU through NVML: fault events, its health at a failure, memory in use."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType

from agent.errors import IdentityError, SourceUnavailable

log = logging.getLogger("pitstop.gpu")


class Verdict(StrEnum):
    """What a fault means for the next start of the engine."""

    HEALTHY = "healthy"
    # The GPU works, but memory held across the failure (holder, preload daemon) may be corrupt.
    MEMORY_SUSPECT = "memory_suspect"
    # Gone, or in need of a reset or service: no restart of the engine can help.
    UNUSABLE = "unusable"


class FaultKind(StrEnum):
    """What was seen; the `kind` label of pitstop_gpu_faults_total."""

    ECC_UNCORRECTED = "ecc_uncorrected"  # a double-bit ECC event, or the volatile count rose
    XID_MEMORY = "xid_memory"            # an Xid that reports an uncorrectable memory error
    XID_FATAL = "xid_fatal"              # an Xid after which the GPU needs a reset
    GPU_LOST = "gpu_lost"                # NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus
    RESET_REQUIRED = "reset_required"    # a pending or failed row remap, or a recovery action


_SEVERITY = {FaultKind.ECC_UNCORRECTED: Verdict.MEMORY_SUSPECT,
             FaultKind.XID_MEMORY: Verdict.MEMORY_SUSPECT}

# Xids (NVIDIA's Xid catalogue, docs.nvidia.com/deploy/xid-errors) that say held memory may be
# corrupt while the GPU itself still works.
MEMORY_XIDS = {48: "double-bit ECC error", 63: "ECC page retirement or row remapping",
               64: "ECC page retirement or row remapping failure",
               92: "high single-bit ECC error rate", 94: "contained ECC error",
               140: "unrecovered ECC error"}
# Xids after which the GPU needs a reset (or service) before anything runs on it again.
FATAL_XIDS = {79: "GPU has fallen off the bus", 95: "uncontained ECC error",
              119: "GSP RPC timeout", 120: "GSP error"}
# Xid 154 says the driver's recovery action changed: what it asks for is read from NVML
# (the health read), since some actions leave a single-GPU engine unaffected.
RECOVERY_ACTION_XID = 154
# Every other Xid (13, 31, 43, 45, ...) is raised by what a program did (an illegal address,
# a killed context), not by the hardware: it is logged, and held memory stays trusted.

# Recovery actions of NVML_FI_DEV_GET_GPU_RECOVERY_ACTION after which nothing runs on the GPU
# until it is done; 0 is "none", 3 and 5 (draining peer-to-peer traffic, recovering an IMEX
# domain) concern traffic between GPUs, which a one-GPU engine does not have.
_RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 4: "draining, then a GPU reset",
                     6: "a bus reset", 7: "a system reboot"}
_FIELD_RECOVERY_ACTION = 230


@dataclass(frozen=True)
class GpuFault:
    """One fault of the engine's GPU, as an event or the health read reported it."""

    kind: FaultKind
    detail: str
    xid: int | None = None
    # When it was seen (the watch's clock, monotonic).
    at: float = 0.0
    # An NVML event (seen once) rather than a finding of the health read (seen at each read).
    event: bool = False

    @property
    def verdict(self) -> Verdict:
        return _SEVERITY.get(self.kind, Verdict.UNUSABLE)


@dataclass(frozen=True)
class GpuCheck:
    """The GPU's state when the supervisor asked: the faults not yet dealt with, and what
    they mean together (the worst of them)."""

    faults: tuple[GpuFault, ...] = ()
    # The volatile uncorrected ECC count this check read; the next baseline once handled.
    ecc_count: int | None = None

    @property
    def verdict(self) -> Verdict:
        verdicts = {f.verdict for f in self.faults}
        for v in (Verdict.UNUSABLE, Verdict.MEMORY_SUSPECT):
            if v in verdicts:
                return v
        return Verdict.HEALTHY

    def describe(self) -> str:
        return "; ".join(dict.fromkeys(f.detail for f in self.faults)) or "healthy"


HEALTHY = GpuCheck()


def classify_xid(xid: int) -> FaultKind | None:
    """The fault an Xid reports, or None for one a program caused."""
    if xid in MEMORY_XIDS:
        return FaultKind.XID_MEMORY
    if xid in FATAL_XIDS:
        return FaultKind.XID_FATAL
    return None


def _nvml_module() -> ModuleType:
    try:
        import pynvml
    except ImportError:
        raise SourceUnavailable("no nvidia-ml-py: pip install nvidia-ml-py") from None
    return pynvml


class GpuWatch:
    """Watches one GPU's NVML events in a thread and reads its health on demand.

    Registers for critical Xid and double-bit ECC events (single-bit errors are corrected
    by the hardware and corrupt nothing), plus the GPU-unavailable and recovery-action events
    where the driver has them. `check()` makes NVML queries (milliseconds): call it from a
    thread, never on the event loop.

    Example::

        watch = GpuWatch("GPU-5b2f...")      # or an NVML index; nvml= a fake in tests
        watch.start()                        # SourceUnavailable on a host without a GPU
        check = watch.check()                # GpuCheck: faults since the last acknowledge
        watch.acknowledge(check)             # dealt with: forget them
        watch.close()
    """

    def __init__(self, selector: int | str, *, nvml: ModuleType | None = None,
                 clock: Callable[[], float] = time.monotonic, wait_ms: int = 1000) -> None:
        self.selector = selector
        self._nvml = nvml
        self._clock = clock
        self._wait_ms = wait_ms
        # Called in the watch's thread with each fault an event reported (set it before a
        # fault can matter: the supervisor does when it starts).
        self.on_fault: Callable[[GpuFault], None] = lambda f: None
        self._lock = threading.Lock()
        self._pending: list[GpuFault] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events = None
        self._handle = None
        self._ecc_baseline: int | None = None
        # The event types the driver accepted for this GPU (0 until start()).
        self.registered = 0

    # --- life ------------------------------------------------------------------------------
    def start(self) -> None:
        nv = self._nv = self._nvml or _nvml_module()
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise SourceUnavailable(f"NVML: {e}: no NVIDIA driver here") from e
        try:
            if isinstance(self.selector, int):
                self._handle = nv.nvmlDeviceGetHandleByIndex(self.selector)
            else:
                self._handle = nv.nvmlDeviceGetHandleByUUID(self.selector)
            self._ecc_baseline = self._ecc_count()
            self._register()
        except nv.NVMLError as e:
            self._events = None
            if self._is(e, "NVML_ERROR_GPU_IS_LOST"):
                # Watched all the same: the supervisor must learn that it has no GPU to use.
                self._handle = None
                self._record(self._lost())
                nv.nvmlShutdown()
                return
            nv.nvmlShutdown()
            raise IdentityError(f"cannot watch GPU {self.selector!r} through NVML: {e}; check "
                                "`nvidia-smi -L` against engine.env CUDA_VISIBLE_DEVICES") from e
        if self._events is not None:
            self._thread = threading.Thread(target=self._run, name="pitstop-gpu-events",
                                            daemon=True)
            self._thread.start()

    def _register(self) -> None:
        nv = self._nv
        wanted = (nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError
                  | getattr(nv, "nvmlEventTypeGpuUnavailableError", 0)
                  | getattr(nv, "nvmlEventTypeGpuRecoveryAction", 0))
        try:
            supported = nv.nvmlDeviceGetSupportedEventTypes(self._handle)
        except nv.NVMLError as e:
            if not self._is(e, "NVML_ERROR_NOT_SUPPORTED"):
                raise
            supported = 0
        mask = wanted & supported
        if not mask:
            log.warning("GPU %s reports no fault events through NVML: faults are seen only "
                        "by the health read when the engine fails", self.selector)
            return
        events = nv.nvmlEventSetCreate()
        try:
            nv.nvmlDeviceRegisterEvents(self._handle, mask, events)
        except BaseException:
            nv.nvmlEventSetFree(events)
            raise
        self._events = events
        self.registered = mask

    def close(self) -> None:
        """Stop watching; the thread frees NVML's event set and session as it leaves."""
        self._stop.set()
        if self._thread is None and self._handle is not None:
            self._handle = None
            self._nv.nvmlShutdown()

    def _is(self, e: Exception, name: str) -> bool:
        return getattr(e, "value", None) == getattr(self._nv, name, object())

    # --- events (the watch's thread) ---------------------------------------------------------
    def _run(self) -> None:
        nv = self._nv
        try:
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(self._events, self._wait_ms)
                except nv.NVMLError as e:
                    if self._is(e, "NVML_ERROR_TIMEOUT"):
                        continue
                    if self._is(e, "NVML_ERROR_GPU_IS_LOST"):
                        self._record(self._lost())
                        return
                    log.error("waiting for NVML events of GPU %s failed (%s): faults are seen "
                              "only by the health read from now on", self.selector, e)
                    return
                fault = self._event_fault(data)
                if fault is not None:
                    self._record(fault)
        finally:
            nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()

    def _event_fault(self, data: object) -> GpuFault | None:
        nv = self._nv
        kind_bits, value = int(data.eventType), int(data.eventData)  # type: ignore[attr-defined]
        now = self._clock()
        if kind_bits & nv.nvmlEventTypeDoubleBitEccError:
            return GpuFault(FaultKind.ECC_UNCORRECTED, "a double-bit (uncorrectable) ECC error",
                            at=now)
        if kind_bits & getattr(nv, "nvmlEventTypeGpuUnavailableError", 0):
            return GpuFault(FaultKind.GPU_LOST, "NVML: the GPU became unavailable", at=now)
        if kind_bits & getattr(nv, "nvmlEventTypeGpuRecoveryAction", 0) or (
                kind_bits & nv.nvmlEventTypeXidCriticalError and value == RECOVERY_ACTION_XID):
            log.warning("GPU %s: the driver's recovery action changed; the health read at the "
                        "next failure or start says what it asks for", self.selector)
            return None
        if kind_bits & nv.nvmlEventTypeXidCriticalError:
            kind = classify_xid(value)
            if kind is None:
                log.info("GPU %s: Xid %d, raised by a program rather than the hardware: held "
                         "memory stays trusted", self.selector, value)
                return None
            what = MEMORY_XIDS.get(value) or FATAL_XIDS[value]
            return GpuFault(kind, f"Xid {value} ({what})", xid=value, at=now)
        return None

    def _lost(self) -> GpuFault:
        return GpuFault(FaultKind.GPU_LOST, "NVML: the GPU is lost (fallen off the bus)",
                        at=self._clock())

    def _record(self, fault: GpuFault) -> None:
        log.error("GPU %s fault: %s", self.selector, fault.detail)
        fault = dataclasses.replace(fault, event=True)
        with self._lock:
            self._pending.append(fault)
        self.on_fault(fault)

    # --- health (any thread but the event loop) ------------------------------------------------
    def check(self) -> GpuCheck:
        """The faults seen since the last acknowledge, and what a health read finds now."""
        found = []
        ecc = None
        if self._handle is None:  # lost before the watch began: nothing left to read
            with self._lock:
                return GpuCheck(faults=tuple(self._pending))
        try:
            ecc = self._ecc_count()
            if ecc is not None and self._ecc_baseline is not None and ecc > self._ecc_baseline:
                found.append(GpuFault(FaultKind.ECC_UNCORRECTED, "volatile uncorrected ECC "
                                      f"errors rose from {self._ecc_baseline} to {ecc}",
                                      at=self._clock()))
            found += self._remap_faults()
            found += self._recovery_action_faults()
        except self._nv.NVMLError as e:
            if not self._is(e, "NVML_ERROR_GPU_IS_LOST"):
                raise IdentityError(f"NVML health read of GPU {self.selector!r} failed: {e}") \
                    from e
            found.append(self._lost())
        with self._lock:
            pending = tuple(self._pending)
        return GpuCheck(faults=(*pending, *found), ecc_count=ecc)

    def acknowledge(self, check: GpuCheck) -> None:
        """The faults of `check` were dealt with (held memory dropped, an engine verified)."""
        with self._lock:
            self._pending = [f for f in self._pending if f not in check.faults]
        if check.ecc_count is not None:
            self._ecc_baseline = check.ecc_count

    def memory_used(self) -> int:
        """Bytes of the GPU's memory in use now, by every process (the holder's included)."""
        if self._handle is None:
            raise SourceUnavailable(f"GPU {self.selector!r} is lost")
        return int(self._nv.nvmlDeviceGetMemoryInfo(self._handle).used)

    def room_for(self, pids: Collection[int]) -> bool:
        """Whether the GPU's memory free now could hold again all that processes `pids` use
        on it (NVML's figure per compute process): False when NVML gives none of them, or a
        figure it cannot read (as in a container that hides the host's PIDs)."""
        if self._handle is None:
            return False
        nv = self._nv
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(self._handle)
            free = int(nv.nvmlDeviceGetMemoryInfo(self._handle).free)
        except nv.NVMLError as e:
            log.info("GPU memory per process not read (%s): a standby waits for a dead tree", e)
            return False
        used = [p.usedGpuMemory for p in procs if p.pid in pids]
        if not used or any(u is None for u in used):
            return False
        return free >= sum(int(u) for u in used)

    def _ecc_count(self) -> int | None:
        nv = self._nv
        try:
            return int(nv.nvmlDeviceGetTotalEccErrors(
                self._handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        except nv.NVMLError as e:
            if self._is(e, "NVML_ERROR_NOT_SUPPORTED"):
                return None  # ECC off, or a GPU without it
            raise

    def _remap_faults(self) -> list[GpuFault]:
        nv = self._nv
        try:
            _corr, _unc, pending, failure = nv.nvmlDeviceGetRemappedRows(self._handle)
        except nv.NVMLError as e:
            if self._is(e, "NVML_ERROR_NOT_SUPPORTED"):
                return []  # before Ampere: pages are retired instead of rows remapped
            raise
        now = self._clock()
        if failure:
            return [GpuFault(FaultKind.RESET_REQUIRED, "a row remapping failed: the GPU's "
                             "memory needs service", at=now)]
        if pending:
            return [GpuFault(FaultKind.RESET_REQUIRED, "a row remapping is pending: the GPU "
                             "needs a reset (nvidia-smi -r)", at=now)]
        return []

    def _recovery_action_faults(self) -> list[GpuFault]:
        nv = self._nv
        try:
            [value] = nv.nvmlDeviceGetFieldValues(self._handle, [_FIELD_RECOVERY_ACTION])
        except nv.NVMLError as e:
            if self._is(e, "NVML_ERROR_NOT_SUPPORTED") or self._is(
                    e, "NVML_ERROR_FUNCTION_NOT_FOUND"):
                return []
            raise
        if value.nvmlReturn != 0:
            return []  # an older driver that does not know the field
        need = _RECOVERY_ACTIONS.get(int(value.value.uiVal))
        if need is None:
            return []
        return [GpuFault(FaultKind.RESET_REQUIRED, f"the driver asks for {need}",
                         at=self._clock())]


class PeakSampler:
    """The most GPU memory in use while it runs, sampled in a thread.

    Example::

        sampler = PeakSampler(watch.memory_used, every_s=0.05)
        sampler.start()
        ...                       # the recovery
        peak = sampler.stop()     # bytes, or None when no sample could be read
    """

    def __init__(self, read: Callable[[], int], every_s: float = 0.05) -> None:
        self._read = read
        self._every = every_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peak: int | None = None
        self._thread = threading.Thread(target=self._run, name="pitstop-gpu-peak", daemon=True)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                used = self._read()
            except Exception as e:  # noqa: BLE001 - a GPU that faults mid-recovery: stop
                log.debug("GPU memory sample failed, sampling stops: %s", e)
                return
            with self._lock:
                self._peak = used if self._peak is None else max(self._peak, used)
            if self._stop.wait(self._every):
                return

    def stop(self) -> int | None:
        """The peak so far; the thread ends by itself within one interval (not joined, so
        that the caller never waits on an NVML call)."""
        self._stop.set()
        with self._lock:
            return self._peak
