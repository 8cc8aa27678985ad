"""CUDA checkpoint's error paths, over a stand-in for the driver API (no GPU needed)."""

from __future__ import annotations

import enum
import threading
from types import SimpleNamespace

import pytest

from agent.checkpoint.cuda import CudaCheckpoint, gpu_pairs, uuid_bytes
from agent.errors import SnapshotError


class CUresult(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_ILLEGAL_STATE = 401


def driver(checkpoint: CUresult, unlock: CUresult) -> SimpleNamespace:
    return SimpleNamespace(
        CUresult=CUresult,
        CUcheckpointLockArgs=SimpleNamespace, CUcheckpointCheckpointArgs=SimpleNamespace,
        CUcheckpointUnlockArgs=SimpleNamespace,
        cuCheckpointProcessLock=lambda pid, args: (CUresult.CUDA_SUCCESS,),
        cuCheckpointProcessCheckpoint=lambda pid, args: (checkpoint,),
        cuCheckpointProcessUnlock=lambda pid, args: (unlock,),
    )


def test_a_failed_checkpoint_is_reported_after_the_unlock():
    cc = CudaCheckpoint(driver=driver(CUresult.CUDA_ERROR_NOT_SUPPORTED, CUresult.CUDA_SUCCESS))
    with pytest.raises(SnapshotError, match="cuCheckpointProcessCheckpoint of PID 7 failed"):
        cc.suspend(7)


def test_when_the_unlock_fails_too_both_errors_are_kept():
    cc = CudaCheckpoint(driver=driver(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                                      CUresult.CUDA_ERROR_ILLEGAL_STATE))
    with pytest.raises(SnapshotError) as e:
        cc.suspend(7)
    text = str(e.value)
    assert "cuCheckpointProcessCheckpoint of PID 7 failed: CUDA_ERROR_NOT_SUPPORTED" in text
    assert "cuCheckpointProcessUnlock (after a failed checkpoint) of PID 7 failed" in text
    assert "stays locked" in text


def restoring_driver(calls: list) -> SimpleNamespace:
    """A stand-in whose restore records the arguments it was given."""
    class Uuid(SimpleNamespace):
        bytes = b""

    return SimpleNamespace(
        CUresult=CUresult, CUcheckpointRestoreArgs=SimpleNamespace,
        CUcheckpointUnlockArgs=SimpleNamespace, CUcheckpointGpuPair=SimpleNamespace,
        CUuuid=Uuid,
        cuCheckpointProcessGetState=lambda pid: (
            CUresult.CUDA_SUCCESS, SimpleNamespace(name="CU_PROCESS_STATE_CHECKPOINTED")),
        cuCheckpointProcessRestore=lambda pid, args: (calls.append(args),
                                                      CUresult.CUDA_SUCCESS)[1:],
        cuCheckpointProcessUnlock=lambda pid, args: (CUresult.CUDA_SUCCESS,),
    )


A = "GPU-3f2a6b1c-0d4e-5f60-7182-93a4b5c6d7e8"
B = "GPU-00112233-4455-6677-8899-aabbccddeeff"


def test_a_snapshot_of_another_gpu_is_restored_through_the_drivers_gpu_pairs():
    calls: list = []
    CudaCheckpoint(driver=restoring_driver(calls)).resume(7, gpu_pairs(A, B))
    [args] = calls
    assert args.gpuPairsCount == 1
    [pair] = args.gpuPairs
    assert pair.oldUuid.bytes == bytes.fromhex("3f2a6b1c0d4e5f60718293a4b5c6d7e8")
    assert pair.newUuid.bytes == bytes.fromhex("00112233445566778899aabbccddeeff")


def test_the_same_gpu_or_no_gpu_needs_no_pairs():
    assert gpu_pairs(A, A) == () and gpu_pairs(None, B) == () and gpu_pairs(A, None) == ()
    calls: list = []
    CudaCheckpoint(driver=restoring_driver(calls)).resume(7)
    assert not hasattr(calls[0], "gpuPairs")


def test_a_uuid_that_is_not_one_is_named():
    with pytest.raises(SnapshotError, match="'GPU-xyz' is not a GPU UUID"):
        uuid_bytes("GPU-xyz")


def stateful_driver(log: list[str]) -> SimpleNamespace:
    """One process, PID 7, its state kept as the driver does (tree_driver)."""
    return tree_driver({7: "CHECKPOINTED"}, log=log)


def test_a_standby_woken_ahead_is_restored_locked_and_only_unlocked_at_the_crash():
    log: list[str] = []
    cc = CudaCheckpoint(driver=stateful_driver(log))
    cc.restore(7)  # ahead of the crash: on the GPU again, its CUDA calls held
    assert cc.state(7) == "locked" and log == ["restore"]
    cc.resume(7)  # at the crash: nothing to restore twice
    assert cc.state(7) == "running" and log == ["restore", "unlock"]


def test_a_resume_of_a_checkpointed_process_restores_then_unlocks():
    log: list[str] = []
    cc = CudaCheckpoint(driver=stateful_driver(log))
    cc.resume(7)
    assert cc.state(7) == "running" and log == ["restore", "unlock"]


def tree_driver(states: dict[int, str], *, log: list[str] | None = None,
                meet: threading.Barrier | None = None,
                failing: int | None = None) -> SimpleNamespace:
    """A stand-in that keeps each process's state as the driver does: checkpointed ->
    (restore) locked -> (unlock) running; a restore of a process not checkpointed fails, and
    so does PID `failing`'s. Each restore waits at `meet`, so restores made one after the
    other never get through it."""
    def restore(pid, args):
        if log is not None:
            log.append("restore")
        if meet is not None:
            meet.wait()
        if pid == failing or states[pid] != "CHECKPOINTED":
            return (CUresult.CUDA_ERROR_ILLEGAL_STATE,)
        states[pid] = "LOCKED"
        return (CUresult.CUDA_SUCCESS,)

    def unlock(pid, args):
        if log is not None:
            log.append("unlock")
        states[pid] = "RUNNING"
        return (CUresult.CUDA_SUCCESS,)

    return SimpleNamespace(
        CUresult=CUresult, CUcheckpointRestoreArgs=SimpleNamespace,
        CUcheckpointUnlockArgs=SimpleNamespace,
        cuCheckpointProcessGetState=lambda pid: (
            CUresult.CUDA_SUCCESS, SimpleNamespace(name=f"CU_PROCESS_STATE_{states[pid]}")),
        cuCheckpointProcessRestore=restore, cuCheckpointProcessUnlock=unlock)


def test_the_processes_of_a_tree_are_restored_side_by_side():
    states = {7: "CHECKPOINTED", 8: "CHECKPOINTED"}
    cc = CudaCheckpoint(driver=tree_driver(states, meet=threading.Barrier(2, timeout=10)))
    each = cc.resume_all((7, 8))
    assert states == {7: "RUNNING", 8: "RUNNING"} and sorted(each) == [7, 8]


def test_a_standby_woken_ahead_restores_its_processes_side_by_side_and_leaves_them_locked():
    states = {7: "CHECKPOINTED", 8: "CHECKPOINTED"}
    CudaCheckpoint(driver=tree_driver(states, meet=threading.Barrier(2, timeout=10))).restore_all(
        (7, 8))
    assert states == {7: "LOCKED", 8: "LOCKED"}


def test_one_process_failing_its_restore_is_named_and_the_others_still_run():
    states = {7: "CHECKPOINTED", 8: "CHECKPOINTED"}
    cc = CudaCheckpoint(driver=tree_driver(states, failing=8))
    with pytest.raises(SnapshotError, match="cuCheckpointProcessRestore of PID 8 failed") as e:
        cc.resume_all((7, 8))
    assert "PID 7" not in str(e.value)
    assert states == {7: "RUNNING", 8: "CHECKPOINTED"}
