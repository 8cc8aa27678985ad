"""CUDA checkpoint's error paths, over a stand-in for the driver API (no GPU needed)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest

from agent.checkpoint.cuda import CudaCheckpoint
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
