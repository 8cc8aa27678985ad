"""Snapshots in an S3-compatible store: push a published one, pull one that fits this host."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from agent.drift import compare, describe
from agent.errors import RemoteError
from agent.identity import REMAPPED_FIELDS, Identity
from agent.refusal import Refusal, RefusalCode
from agent.store.files import DIR_MODE, FILE_MODE
from agent.store.manifest import ImageFile, Manifest, SnapshotKind
from agent.store.s3 import Bucket, ObjectTooLong, Transfers, WindowReader, WindowWriter
from agent.store.store import SnapshotStore

log = logging.getLogger("pitstop.remote")

# The bucket's layout under its prefix: every image chunk once, named by its sha256 (the
# manifest's `files[].sha256_chunks`), so a snapshot uploads only the chunks the store does
# not hold yet; and one manifest per snapshot, written after all its chunks.
CHUNKS = "chunks"
MANIFESTS = "manifests"
# vLLM's own snapshots record their own path in the dumped tree: only Pitstop's travel.
PORTABLE_KINDS: tuple[SnapshotKind, ...] = ("hybrid", "full")
# Manifests read, newest first, when looking for one that fits this host.
NEWEST_READ = 64
# Room left on the snapshot file system beside a pulled image.
HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True)
class Transfer:
    """One push or pull: what moved, how fast, and how it ended (`result` "ok", or the
    refusal code of why not), as `pitstop status` and the CLI show it."""

    direction: str  # "push" or "pull"
    result: str
    snapshot: str  # the snapshot's id; "" when none was chosen
    detail: str
    kind: str = ""
    # Bytes sent or received; `reused_bytes` were in place already (chunks the store had, a
    # snapshot the local store had).
    bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0
    at: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def chunk_key(sha256: str) -> str:
    return f"{CHUNKS}/{sha256}"


def manifest_key(snapshot_id: str) -> str:
    return f"{MANIFESTS}/{snapshot_id}.json"


@dataclass(frozen=True)
class _Piece:
    """Where one chunk lies in an image: file, byte offset, length."""

    file: str
    offset: int
    length: int


def _pieces(m: Manifest) -> dict[str, list[_Piece]]:
    """Every chunk digest of the image and each place it lies (a chunk of zeros lies in many)."""
    out: dict[str, list[_Piece]] = {}
    for f in m.files:
        for i, sha in enumerate(f.sha256_chunks):
            offset = i * m.chunk_bytes
            out.setdefault(sha, []).append(_Piece(f.name, offset,
                                                  max(0, min(m.chunk_bytes, f.size - offset))))
    return out


def _failed(what: str, e: BaseException) -> RemoteError:
    return RemoteError(Refusal(RefusalCode.TRANSFER_FAILED, f"{what}: {e}"))


# --- push -------------------------------------------------------------------------------


def push(store: SnapshotStore, snapshot_id: str, bucket: Bucket,
         clock: Callable[[], float] = time.monotonic) -> Transfer:
    """Upload snapshot `snapshot_id` of `store` to `bucket`: the chunks it does not hold yet,
    in parallel, then the manifest, which makes it visible to pulls. The local snapshot is
    verified first (a damaged one is never spread). Raises RemoteError."""
    t0 = clock()
    verdict = store.verify(snapshot_id, full=not store.trust_sealed)
    if not verdict.ok or verdict.manifest is None:
        raise RemoteError(Refusal(RefusalCode.CORRUPT, f"snapshot {snapshot_id} does not "
                                  f"verify, not pushed: {'; '.join(verdict.reasons)}"))
    m = verdict.manifest
    if m.kind not in PORTABLE_KINDS:
        raise RemoteError(Refusal(RefusalCode.WRONG_KIND, f"snapshot {m.id} is vLLM's own "
                                  "(kind vllm), which records its path on this host; only "
                                  "full and hybrid snapshots go to a remote store"))
    pieces = _pieces(m)
    try:
        held = dict(bucket.names(CHUNKS))
        todo = {sha: at[0] for sha, at in pieces.items() if held.get(sha) != at[0].length}
        with _open_files(store.path(m.id), {p.file for p in todo.values()}, os.O_RDONLY) as fds:
            _run(bucket, [(chunk_key(sha), "up", fds[p.file], p) for sha, p in todo.items()],
                 deadline=None, clock=clock)
        bucket.put(manifest_key(m.id), m.model_dump_json(indent=1).encode())
    except Exception as e:  # botocore's, s3transfer's (retries exhausted), the disk's
        raise _failed(f"push of snapshot {m.id} to {bucket.url}", e) from e
    sent = sum(p.length for p in todo.values())
    unique = sum(at[0].length for at in pieces.values())
    done = Transfer("push", "ok", m.id, f"{len(todo)} of {len(pieces)} chunks uploaded",
                    kind=m.kind, bytes=sent, reused_bytes=unique - sent,
                    seconds=clock() - t0, at=time.time())
    log.info("pushed snapshot %s to %s: %s, %.1f MB sent (%.1f MB were there) in %.2fs",
             m.id, bucket.url, done.detail, sent / 1e6, done.reused_bytes / 1e6, done.seconds)
    return done


# --- pull -------------------------------------------------------------------------------


def find(bucket: Bucket, identity: Identity, kinds: Sequence[SnapshotKind] = PORTABLE_KINDS,
         remapped: Collection[str] = REMAPPED_FIELDS) -> Manifest:
    """The newest snapshot in `bucket` whose identity fits `identity` (all but `remapped`),
    of the first of `kinds` that has one. RemoteError: none (no_snapshot), or none that fits
    (stale, naming each field of the newest that differs)."""
    names = sorted((n for n, _ in bucket.names(MANIFESTS) if n.endswith(".json")),
                   reverse=True)[:NEWEST_READ]
    best: dict[str, Manifest] = {}
    stale: tuple[str, str] | None = None
    for name in names:
        raw = bucket.get(f"{MANIFESTS}/{name}")
        try:
            m = Manifest.model_validate_json(raw or b"")
        except ValidationError as e:
            log.warning("%s/%s/%s is not a manifest, skipped: %s", bucket.url, MANIFESTS,
                        name, e.errors()[0]["msg"])
            continue
        if f"{m.id}.json" != name or m.kind not in kinds or m.kind in best:
            continue
        diffs = compare(m.identity, identity, remapped)
        if diffs:
            stale = stale or (m.id, describe(diffs))
            continue
        best[m.kind] = m
        if m.kind == kinds[0]:
            break
    for kind in kinds:
        if kind in best:
            return best[kind]
    if stale is not None:
        raise RemoteError(Refusal(RefusalCode.STALE, f"{bucket.url} has no snapshot for this "
                                  f"host; the newest, {stale[0]}, differs: {stale[1]}"))
    raise RemoteError(Refusal(RefusalCode.NO_SNAPSHOT, f"{bucket.url} has no "
                              f"{' or '.join(kinds)} snapshot"))


def pull(store: SnapshotStore, bucket: Bucket, identity: Identity, *,
         kinds: Sequence[SnapshotKind] = PORTABLE_KINDS,
         remapped: Collection[str] = REMAPPED_FIELDS, timeout_s: float | None = None,
         clock: Callable[[], float] = time.monotonic) -> Transfer:
    """Download the newest snapshot of `bucket` that fits `identity` into `store`.

    The image is written into a draft of the store, every chunk checked against the sha256
    it is named by, then published under the snapshot's own id; anything that goes wrong
    (a corrupt or missing object, the network, `timeout_s`, a full disk, this process
    killed) leaves nothing published. Raises RemoteError with the refusal."""
    t0 = clock()
    deadline = None if timeout_s is None else t0 + timeout_s
    try:
        m = find(bucket, identity, kinds, remapped)
    except RemoteError:
        raise
    except Exception as e:  # botocore's: the store cannot be reached or refuses us
        raise _failed(f"listing {bucket.url}", e) from e
    if m.id in store.ids():
        return Transfer("pull", "ok", m.id, "already in the local store", kind=m.kind,
                        reused_bytes=m.image_bytes, seconds=clock() - t0, at=time.time())
    store.open()
    free = shutil.disk_usage(store.root).free
    if free < m.image_bytes + HEADROOM_BYTES:
        raise RemoteError(Refusal(RefusalCode.TRANSFER_FAILED, f"snapshot {m.id} needs "
                                  f"{m.image_bytes / 1e9:.2f} GB and {store.root} has "
                                  f"{free / 1e9:.2f} GB free"))
    got = 0
    with store.begin(m.kind, snapshot_id=m.id) as draft:
        draft.chunk_bytes = m.chunk_bytes
        got = _download(bucket, m, draft.dir, deadline, clock)
        _check(bucket, m, draft.seal())
        draft.publish(m)
    done = Transfer("pull", "ok", m.id, f"pulled from {bucket.url}", kind=m.kind, bytes=got,
                    seconds=clock() - t0, at=time.time())
    log.info("pulled snapshot %s (%s) from %s: %.1f MB in %.2fs (%.0f MB/s)", m.id, m.kind,
             bucket.url, got / 1e6, done.seconds, done.mb_per_s)
    return done


def _download(bucket: Bucket, m: Manifest, into: Path, deadline: float | None,
              clock: Callable[[], float]) -> int:
    """Every distinct chunk once, in parallel; then the copies of repeated ones (zeros)."""
    for f in m.files:
        if "/" in f.name:
            (into / f.name).parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    pieces = _pieces(m)
    with _open_files(into, {f.name for f in m.files},
                     os.O_RDWR | os.O_CREAT | os.O_EXCL) as fds:
        for f in m.files:
            os.ftruncate(fds[f.name], f.size)
        jobs = [(chunk_key(sha), "down", fds[at[0].file], at[0])
                for sha, at in pieces.items() if at[0].length]
        try:
            _run(bucket, jobs, deadline, clock)
        except ObjectTooLong as e:
            raise RemoteError(Refusal(RefusalCode.CORRUPT, f"snapshot {m.id}: {e}")) from e
        except Exception as e:  # botocore's, s3transfer's (retries exhausted), the disk's
            if _missing(e):
                raise RemoteError(Refusal(RefusalCode.CORRUPT, f"snapshot {m.id} in "
                                          f"{bucket.url} is incomplete: {e}")) from e
            raise _failed(f"pull of snapshot {m.id} from {bucket.url}", e) from e
        for at in pieces.values():
            for p in at[1:]:
                os.pwrite(fds[p.file], os.pread(fds[at[0].file], p.length, at[0].offset),
                          p.offset)
    return sum(at[0].length for at in pieces.values())


def _missing(e: BaseException) -> bool:
    code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


def _check(bucket: Bucket, m: Manifest, sealed: tuple[ImageFile, ...]) -> None:
    """Refuse the pulled image unless each chunk hashes to the name of the object it came
    from; the first object that does not is named."""
    got = {f.name: f for f in sealed}
    for f in m.files:
        g = got.get(f.name)
        if g is None or g.size != f.size:
            raise RemoteError(Refusal(RefusalCode.CORRUPT, f"snapshot {m.id}: {f.name} came "
                                      f"out {g.size if g else 0} bytes, not {f.size}"))
        for i, (want, have) in enumerate(zip(f.sha256_chunks, g.sha256_chunks, strict=True)):
            if want != have:
                raise RemoteError(Refusal(RefusalCode.CORRUPT, (
                    f"object {bucket.url}/{chunk_key(want)} is corrupt: its bytes hash to "
                    f"sha256 {have} (snapshot {m.id}, {f.name} at byte {i * m.chunk_bytes}); "
                    "delete it and push the snapshot again from a node that has it")))


@contextlib.contextmanager
def _open_files(directory: Path, names: Collection[str], flags: int) -> Iterator[dict[str, int]]:
    fds: dict[str, int] = {}
    try:
        for name in sorted(names):
            fds[name] = os.open(directory / name, flags | os.O_NOFOLLOW, FILE_MODE)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _run(bucket: Bucket, jobs: list[tuple[str, str, int, _Piece]], deadline: float | None,
         clock: Callable[[], float]) -> None:
    """Run the uploads ("up") and downloads ("down") of `jobs` (key, way, fd, piece) at
    once on one TransferManager; the first failure, or the deadline, cancels the rest."""
    tx = bucket.transfers()
    futures: list[Future] = []
    expired = threading.Event()
    timer = None
    try:
        futures += [_submit(tx, bucket, job) for job in jobs]
        if deadline is not None:
            timer = _cancel_at(deadline - clock(), futures, expired)
        for f in futures:
            try:
                f.result()
            except BaseException as e:
                if expired.is_set():
                    raise TimeoutError("the transfer did not finish in time "
                                       "(snapshots.pull_timeout_s)") from e
                raise
    except BaseException:
        for f in futures:
            f.cancel()
        tx.close(cancel=True)
        raise
    finally:
        if timer is not None:
            timer.cancel()
    tx.close()


def _submit(tx: Transfers, bucket: Bucket, job: tuple[str, str, int, _Piece]) -> Future:
    key, way, fd, p = job
    if way == "up":
        return tx.upload(key, WindowReader(fd, p.offset, p.length))
    return tx.download(key, WindowWriter(fd, p.offset, p.length, f"{bucket.url}/{key}"))


def _cancel_at(seconds: float, futures: list[Future], expired: threading.Event
               ) -> threading.Timer:
    """A timer that cancels every transfer of `futures` after `seconds`, flagging `expired`."""
    def expire() -> None:
        expired.set()
        for f in futures:
            f.cancel()

    timer = threading.Timer(max(0.0, seconds), expire)
    timer.daemon = True
    timer.start()
    return timer
