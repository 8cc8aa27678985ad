"""The holder's wire protocol: versioned JSON messages and fds over a SOCK_SEQPACKET socket."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

VERSION = 1
# One message is one datagram; a SEQPACKET datagram must fit the socket's send buffer.
MAX_MESSAGE = 64 * 1024
# The most fds one answer carries (one per chunk of a region).
MAX_FDS = 253
SOCKET_NAME = "holder.sock"
LOCK_NAME = "holder.lock"
# Region names become parts of memfd names and log lines: keep them plain.
NAME_PATTERN = r"^[A-Za-z0-9._:/+=-]{1,200}$"
DIGEST_PATTERN = r"^[A-Za-z0-9._:+=-]{1,128}$"


class ErrorCode(StrEnum):
    """Why a request was refused; the session goes on after any of these."""

    BAD_REQUEST = "bad_request"      # not JSON, unknown op, a field out of range
    VERSION = "version"              # the client speaks another protocol version
    FORBIDDEN = "forbidden"          # the peer's uid is not allowed (the connection closes)
    NOT_FOUND = "not_found"          # no region of that name
    NOT_COMMITTED = "not_committed"  # the region exists but its writer has not committed
    BUSY = "busy"                    # another session is writing a region of that name
    NOT_OWNER = "not_owner"          # commit/abort of a region this session did not create
    NO_MEMORY = "no_memory"          # the backend could not allocate, or --max-bytes is reached
    NO_PLAN = "no_plan"              # refill: no refill plan for that digest in the directory
    DRIFT = "drift"                  # refill: the plan's files changed on disk since it was made
    REFILL_FAILED = "refill_failed"  # refill: a read or copy failed; nothing was committed


class MemoryKind(StrEnum):
    """What memory a region is made of."""

    # The backend's own: device memory on the cuda backend, a memfd on the cpu backend.
    DEVICE = "device"
    # A memfd on every backend: small bookkeeping a tenant writes with plain stores and
    # must find again after it dies (the KV ledger), which device memory would make slow.
    HOST = "host"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Req(_Msg):
    v: Literal[1] = VERSION


class CreateRequest(_Req):
    """Allocate a region for writing; the answer carries its fds. Replaces on commit."""

    op: Literal["create"] = "create"
    name: str = Field(pattern=NAME_PATTERN)
    size: int = Field(gt=0, le=1 << 44)
    digest: str = Field(pattern=DIGEST_PATTERN)
    # How many regions share this digest; a set is complete when that many are committed.
    parts: int = Field(1, ge=1, le=100_000)
    memory: MemoryKind = MemoryKind.DEVICE
    # Seconds the committed region may stay unclaimed before the holder releases it
    # itself: memory a dead tenant left for its successor, which must not be held forever
    # when none comes. The process that created or last attached it claims it until it
    # exits; another process's attach meanwhile is `busy`. None: kept until released,
    # as weights are, and attachable by any number of processes.
    lease_s: float | None = Field(None, gt=0, le=7 * 86400)


class NameRequest(_Req):
    """commit / attach / release of one named region."""

    op: Literal["commit", "attach", "release"]
    name: str = Field(pattern=NAME_PATTERN)


class ListRequest(_Req):
    """Every region, or only those of one digest (what a tenant asks about its weights)."""

    op: Literal["list"] = "list"
    digest: str | None = Field(None, pattern=DIGEST_PATTERN)


class StatsRequest(_Req):
    op: Literal["stats"] = "stats"


class DropReason(StrEnum):
    """Why a client asked the holder to drop everything."""

    GPU_FAULT = "gpu_fault"  # the GPU faulted (Xid, uncorrectable ECC): held bytes are suspect


class DropRequest(_Req):
    """Free every region, committed or being written, at once; the holder keeps serving.

    A writer whose region was dropped gets `not_found` at its commit; engines that have the
    memory mapped keep their mapping until they unmap it (the driver frees it then).
    """

    op: Literal["drop"] = "drop"
    reason: DropReason
    # What the client saw, for the holder's log.
    detail: str = Field("", max_length=1000)


class RefillRequest(_Req):
    """Load the weights of `digest` from the refill plan in the holder's directory and
    commit them; answered when they are committed (or not). A refill of that digest
    already running is joined, not started twice."""

    op: Literal["refill"] = "refill"
    digest: str = Field(pattern=DIGEST_PATTERN)


AnyRequest = (CreateRequest | NameRequest | ListRequest | StatsRequest | DropRequest
              | RefillRequest)
Request = Annotated[AnyRequest, Field(discriminator="op")]
_request_adapter: TypeAdapter[AnyRequest] = TypeAdapter(Request)


class RegionInfo(_Msg):
    """One region as the holder reports it. `chunks` are the sizes of its fds, in order."""

    name: str
    size: int
    digest: str
    parts: int
    epoch: int
    holder_id: str
    committed: bool
    chunks: list[int]
    align: int
    memory: MemoryKind = MemoryKind.DEVICE
    lease_s: float | None = None

    @property
    def mapped_size(self) -> int:
        """Bytes of address space the region takes when its chunks are mapped back to back."""
        return sum(self.chunks)


class Stats(_Msg):
    """What the holder holds, in bytes, and who it is."""

    holder_id: str
    pid: int
    backend: str
    gpu: str
    bytes_committed: int
    bytes_pending: int
    regions_committed: int
    regions_pending: int
    sessions: int

    @property
    def bytes_held(self) -> int:
        return self.bytes_committed + self.bytes_pending


class Dropped(_Msg):
    """What a drop freed."""

    regions: int
    bytes: int


class Refilled(_Msg):
    """What a refill loaded; `bytes` is 0 when the set was held already."""

    digest: str
    regions: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Load throughput in GB/s (10^9 bytes a second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class ErrorInfo(_Msg):
    code: ErrorCode
    message: str


class Reply(_Msg):
    """Every answer: ok with at most one payload, or an error."""

    v: Literal[1] = VERSION
    ok: bool
    error: ErrorInfo | None = None
    region: RegionInfo | None = None
    regions: list[RegionInfo] | None = None
    stats: Stats | None = None
    dropped: Dropped | None = None
    refilled: Refilled | None = None


class _Part(Protocol):
    @property
    def parts(self) -> int: ...


def whole_set(committed: Sequence[_Part]) -> bool:
    """Whether the committed regions of one digest are all of its set: each says how many
    parts the set has (`parts`), and that many are there. Half a set is never one."""
    return bool(committed) and all(r.parts == len(committed) for r in committed)


def error_reply(code: ErrorCode, message: str) -> Reply:
    """The answer to a request refused with `code`."""
    return Reply(ok=False, error=ErrorInfo(code=code, message=message))


class ProtocolError(ValueError):
    """A message that does not parse; carries the code the answer should have."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_request(data: bytes) -> AnyRequest:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"not a JSON message: {e}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a request is a JSON object")
    if raw.get("v") != VERSION:
        raise ProtocolError(
            ErrorCode.VERSION,
            f"protocol version {raw.get('v')!r} is not spoken here (holder speaks {VERSION}); "
            "upgrade the client or the holder so they match")
    try:
        return _request_adapter.validate_python(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(message)"
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {first['msg']}") from None


def parse_reply(data: bytes) -> Reply:
    return Reply.model_validate_json(data)


def encode(msg: _Msg) -> bytes:
    data = msg.model_dump_json(exclude_none=True).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    return data


def send(sock: socket.socket, msg: _Msg, fds: list[int] | None = None) -> None:
    data = encode(msg)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One datagram and the fds that came with it; b'' at end of stream."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            _close_quietly(fd)
        raise ProtocolError(ErrorCode.BAD_REQUEST, "fds were truncated in transit")
    if flags & socket.MSG_TRUNC:
        # The kernel dropped the rest of the datagram: what is left may still parse (a
        # request padded past the limit), and must not be carried out.
        for fd in fds:
            _close_quietly(fd)
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"message longer than {MAX_MESSAGE} bytes; send a shorter one")
    return data, list(fds)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def socket_path(base: str, gpu: str) -> str:
    """`<base>/<gpu uuid or 'cpu'>/holder.sock`, the one place both sides derive it from."""
    return os.path.join(base, gpu, SOCKET_NAME)
