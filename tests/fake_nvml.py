"""An NVML stand-in for tests: pynvml's own constants, a GPU whose faults a test injects."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

# pynvml's names, used as they are: only the functions below are faked.
_CONSTANTS = {n: getattr(pynvml, n) for n in dir(pynvml)
              if n.startswith(("NVML_", "nvmlEventType"))}


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    """What the fake driver reports; a test changes it and calls `event()`."""

    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    supported_events: int = (pynvml.nvmlEventTypeXidCriticalError
                              | pynvml.nvmlEventTypeDoubleBitEccError
                              | pynvml.nvmlEventTypeSingleBitEccError)
    ecc_uncorrected: int | None = 0
    remap_pending: bool = False
    remap_failure: bool = False
    recovery_action: int | None = 0  # None: a driver without the field
    memory_used: int = 1 << 30
    # pid -> bytes it uses (None: "not available", as NVML says in a container)
    processes: dict[int, int | None] = field(default_factory=dict)
    lost: bool = False
    registered: list[int] = field(default_factory=list)
    events: queue.Queue = field(default_factory=queue.Queue)
    inits: int = 0


class FakeNvml(SimpleNamespace):
    """A module object with pynvml's interface over one `FakeGpu` (index 0)."""

    def __init__(self, gpu: FakeGpu | None = None) -> None:
        super().__init__(**_CONSTANTS)
        self.gpu = gpu or FakeGpu()
        self.NVMLError = NVMLError
        self._lock = threading.Lock()
        self.freed_sets = 0

    # --- what a test does -------------------------------------------------------------------
    def xid(self, number: int) -> None:
        self.gpu.events.put((pynvml.nvmlEventTypeXidCriticalError, number))

    def double_bit_ecc(self) -> None:
        self.gpu.ecc_uncorrected = (self.gpu.ecc_uncorrected or 0) + 1
        self.gpu.events.put((pynvml.nvmlEventTypeDoubleBitEccError, 0))

    def fall_off_the_bus(self) -> None:
        self.gpu.lost = True
        self.gpu.events.put(None)

    # --- pynvml's functions -------------------------------------------------------------------
    def _alive(self) -> None:
        if self.gpu.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlInit(self) -> None:
        with self._lock:
            self.gpu.inits += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self.gpu.inits -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._alive()
        if index != 0:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpu.uuid

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self._alive()
        if uuid != self.gpu.uuid:
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return uuid

    def nvmlDeviceGetSupportedEventTypes(self, handle: str) -> int:
        return self.gpu.supported_events

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: str, types: int, event_set: object) -> None:
        self.gpu.registered.append(types)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        try:
            item = self.gpu.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        if item is None:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        kind, data = item
        return SimpleNamespace(device=self.gpu.uuid, eventType=kind, eventData=data,
                               gpuInstanceId=0, computeInstanceId=0)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.freed_sets += 1

    def nvmlDeviceGetTotalEccErrors(self, handle: str, error_type: int, counter: int) -> int:
        self._alive()
        if self.gpu.ecc_uncorrected is None:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.gpu.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        self._alive()
        return (0, 0, int(self.gpu.remap_pending), int(self.gpu.remap_failure))

    def nvmlDeviceGetFieldValues(self, handle: str, ids: list[int]) -> list[SimpleNamespace]:
        self._alive()
        action = self.gpu.recovery_action
        return [SimpleNamespace(fieldId=i, nvmlReturn=0 if action is not None else
                                pynvml.NVML_ERROR_NOT_SUPPORTED,
                                value=SimpleNamespace(uiVal=action or 0)) for i in ids]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:
        self._alive()
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self.gpu.processes.items()]

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        self._alive()
        return SimpleNamespace(total=80 << 30, used=self.gpu.memory_used,
                               free=(80 << 30) - self.gpu.memory_used)
