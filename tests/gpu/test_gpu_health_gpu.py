"""The GPU watch on a real GPU: NVML takes the fault-event registration, and a healthy GPU
reports no event and no fault. Run on the device machine:

    python3 -m pytest -m gpu --noconftest tests/gpu/test_gpu_health_gpu.py -s

Needs only the agent package and nvidia-ml-py (`--noconftest`: tests/conftest.py imports the
holder's pydantic models); nothing here allocates GPU memory."""

from __future__ import annotations

import threading
import time

import pytest

from agent.errors import SourceUnavailable
from agent.gpu_health import GpuWatch, PeakSampler, Verdict

pytestmark = pytest.mark.gpu

pynvml = pytest.importorskip("pynvml")


@pytest.fixture
def watch():
    w = GpuWatch(0, wait_ms=250)
    try:
        w.start()
    except SourceUnavailable as e:
        # Skipped, not failed, without a GPU even under CI=true: CI has none by design.
        pytest.skip(f"no NVIDIA GPU here: {e}")
    yield w
    w.close()


def names(mask: int) -> list[str]:
    return [n for n in dir(pynvml) if n.startswith("nvmlEventType") and n != "nvmlEventTypeAll"
            and getattr(pynvml, n) and mask & getattr(pynvml, n) == getattr(pynvml, n)]


def test_nvml_takes_the_fault_registration_and_a_healthy_gpu_reports_no_fault(watch):
    assert watch.registered & pynvml.nvmlEventTypeXidCriticalError, names(watch.registered)
    # Corrected errors are not watched: they corrupt nothing.
    assert not watch.registered & pynvml.nvmlEventTypeSingleBitEccError
    thread = next(t for t in threading.enumerate() if t.name == "pitstop-gpu-events")
    time.sleep(3.0)  # a dozen event waits run out without an event
    assert thread.is_alive()
    check = watch.check()
    assert check.verdict is Verdict.HEALTHY, check.describe()
    assert check.faults == ()
    print(f"\nregistered for {names(watch.registered)}; volatile uncorrected ECC errors: "
          f"{check.ecc_count}")
    watch.close()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_the_event_wait_itself_times_out_on_a_healthy_gpu():
    """The same registration through pynvml directly: the wait ends in NVML_ERROR_TIMEOUT."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        pytest.skip(f"no NVIDIA driver here: {e}")
    events = None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mask = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError) \
            & pynvml.nvmlDeviceGetSupportedEventTypes(handle)
        events = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(handle, mask, events)
        t0 = time.monotonic()
        with pytest.raises(pynvml.NVMLError) as e:
            pynvml.nvmlEventSetWait_v2(events, 1000)
        assert e.value.value == pynvml.NVML_ERROR_TIMEOUT, e.value
        assert time.monotonic() - t0 >= 0.9
    finally:
        if events is not None:
            pynvml.nvmlEventSetFree(events)
        pynvml.nvmlShutdown()


def test_the_peak_sampler_reads_the_memory_in_use(watch):
    total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    sampler = PeakSampler(watch.memory_used, every_s=0.05).start()
    time.sleep(0.5)
    peak = sampler.stop()
    assert peak is not None and 0 < peak <= total
    print(f"\nGPU memory in use: {peak / 2**30:.2f} GiB of {total / 2**30:.1f} GiB")
