"""Pieces of the holder that need no process or GPU: CUDA argument building, error
mapping, layouts, request parsing."""

from __future__ import annotations

import enum

import pytest

from agent.holder import protocol as p
from agent.holder.backends import BackendError, GpuFaultError
from agent.holder.backends.cuda import check, format_uuid, plan_chunks
from agent.tenant.mapping import layout

GIB = 1 << 30
G2M = 2 << 20


class FakeResult(enum.IntEnum):
    """Stands in for cuda-bindings' CUresult: an int enum with CUDA_* names."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_ECC_UNCORRECTABLE = 214


def test_chunks_are_granular_and_at_most_a_gib():
    assert plan_chunks(1, G2M) == [G2M]
    assert plan_chunks(GIB, G2M) == [GIB]
    assert plan_chunks(GIB + 1, G2M) == [GIB, G2M]
    assert plan_chunks(5 * GIB + 3 * G2M - 7, G2M) == [GIB] * 5 + [3 * G2M]
    # A granularity that does not divide 1 GiB still gives granular chunks.
    g = 3 << 20
    assert all(c % g == 0 for c in plan_chunks(3 * GIB, g))
    assert sum(plan_chunks(3 * GIB, g)) >= 3 * GIB
    with pytest.raises(ValueError):
        plan_chunks(0, G2M)


def test_uuid_is_formatted_like_nvidia_smi():
    raw = bytes(range(16))
    assert format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    with pytest.raises(ValueError):
        format_uuid(b"short")


def test_cuda_results_map_to_typed_errors():
    assert check((FakeResult.CUDA_SUCCESS, 42), "x") == 42
    assert check((FakeResult.CUDA_SUCCESS,), "x") is None
    assert check((FakeResult.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    with pytest.raises(BackendError, match="cuMemCreat.*OUT_OF_MEMORY.*release") as e:
        check((FakeResult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemCreate")
    assert not isinstance(e.value, GpuFaultError)
    with pytest.raises(GpuFaultError, match="Xid"):
        check((FakeResult.CUDA_ERROR_ECC_UNCORRECTABLE,), "cuMemCreate")
    with pytest.raises(BackendError, match="INVALID_VALUE"):
        check(FakeResult.CUDA_ERROR_INVALID_VALUE, "cuMemMap")


def _region(name: str, chunks: list[int], align: int) -> p.RegionInfo:
    return p.RegionInfo(name=name, size=sum(chunks) - 1, digest="d", parts=2, epoch=1,
                        holder_id="h", committed=True, chunks=chunks, align=align)


def test_layout_places_regions_back_to_back_on_the_alignment():
    regions = [_region("a", [GIB, G2M], G2M), _region("b", [G2M], G2M)]
    placements, total = layout(regions, G2M)
    assert [pl.offset for pl in placements] == [0, GIB + G2M]
    assert total == GIB + 2 * G2M


def test_requests_parse_strictly():
    req = p.parse_request(b'{"v": 1, "op": "create", "name": "d/a", "size": 5, "digest": "d"}')
    assert isinstance(req, p.CreateRequest) and req.parts == 1
    for raw, code in [(b"[]", p.ErrorCode.BAD_REQUEST), (b'{"op": "list"}', p.ErrorCode.VERSION),
                      (b'{"v": 1, "op": "list", "extra": 1}', p.ErrorCode.BAD_REQUEST),
                      (b'{"v": 1, "op": "create", "name": "a", "size": 0, "digest": "d"}',
                       p.ErrorCode.BAD_REQUEST)]:
        with pytest.raises(p.ProtocolError) as e:
            p.parse_request(raw)
        assert e.value.code == code, raw


FAULTY_HOLDER = """
import sys
from pathlib import Path
from agent.holder.backends import GpuFaultError
from agent.holder.backends.cpu import CpuBackend
from agent.holder.server import HolderServer

class Faulty(CpuBackend):
    def allocate(self, name, size):
        raise GpuFaultError("cuMemCreate: CUDA_ERROR_ECC_UNCORRECTABLE")

server = HolderServer(Faulty("cpu"), Path(sys.argv[1]))
server.bind()
print("ready", flush=True)
raise SystemExit(server.serve())
"""


def test_a_gpu_fault_stops_the_holder_with_status_74(tmp_path):
    import subprocess
    import sys

    from agent.errors import HolderUnavailableError
    from agent.holder.client import HolderClient
    from agent.holder.server import EXIT_GPU_FAULT
    from tests.holder_proc import REPO

    h = subprocess.Popen([sys.executable, "-c", FAULTY_HOLDER, str(tmp_path)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert h.stdout is not None and h.stdout.readline().strip() == "ready"
        with HolderClient.for_gpu(tmp_path, "cpu") as c, pytest.raises(HolderUnavailableError):
            c.create("d/w", 4096, "d")
        assert h.wait(timeout=30) == EXIT_GPU_FAULT
        assert h.stderr is not None and "ECC_UNCORRECTABLE" in h.stderr.read()
        assert not (tmp_path / "cpu" / p.SOCKET_NAME).exists()
    finally:
        if h.poll() is None:
            h.kill()
            h.wait()


class CountingBackend:
    """A stand-in allocator for the region table's own rules (the real ones run in
    test_holder.py): hands out fake fd numbers and counts what is live."""

    name, gpu, align = "fake", "cpu", 4096

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.next_fd = 1000

    def allocate(self, name, size):
        from agent.holder.backends import Allocation

        self.next_fd += 1
        self.live.add(self.next_fd)
        return Allocation(fds=[self.next_fd], chunks=[-(-size // 4096) * 4096])

    def free(self, a):
        for fd in a.fds:
            self.live.remove(fd)
        a.fds.clear()

    def close(self):
        pass


def test_region_table_rules():
    from agent.errors import HolderInvariantError
    from agent.holder.regions import RegionTable, RequestRefused

    b = CountingBackend()
    t = RegionTable(b, "hid", max_bytes=3 * 4096)
    w, other = object(), object()
    sessions = {id(w), id(other)}
    t.create(w, "n", 10, "d", 1)
    t.commit(w, "n")
    t.create(w, "n", 10, "d", 1)  # a replacement, pending
    assert t.attach("n").epoch == 1 and len(b.live) == 2
    t.commit(w, "n")
    assert t.attach("n").epoch == 2 and len(b.live) == 1  # the old version was freed
    t.release(other, "n")
    assert t.create(other, "n", 10, "d", 1).epoch == 3  # epochs never go back
    with pytest.raises(RequestRefused) as e:
        t.create(w, "n", 10, "d", 1)
    assert e.value.code == p.ErrorCode.BUSY
    with pytest.raises(RequestRefused) as e:
        t.create(w, "big", 3 * 4096, "d", 1)
    assert e.value.code == p.ErrorCode.NO_MEMORY
    t.check(sessions)
    assert t.session_closed(other) == ["n"] and not b.live
    assert (t.bytes_committed, t.bytes_pending) == (0, 0)
    t.create(w, "x", 1, "d", 1)
    t.bytes_pending += 1  # books that no longer add up stop the holder
    with pytest.raises(HolderInvariantError, match="recounted"):
        t.check(sessions)
    t.bytes_pending -= 1
    with pytest.raises(HolderInvariantError, match="no live writer"):
        t.check({id(other)})
