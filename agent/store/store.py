"""Snapshot directories under one root: publish atomically, verify, select, quarantine, prune."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from agent.config import Config, SnapshotsConfig
from agent.drift import compare, describe
from agent.errors import SnapshotError, SnapshotUnusableError
from agent.identity import Identity
from agent.refusal import Refusal, RefusalCode
from agent.store.files import (
    CHUNK_BYTES,
    DIR_MODE,
    FILE_MODE,
    check_private_dir,
    check_root,
    chunk_digests,
    chunks_differ,
    chunks_key,
    fsync_dir,
    fsync_file,
    make_private_dir,
    private_file,
    read_private,
    stat_key,
    tree_bytes,
    unlisted_files,
    walk_files,
    write_private,
)
from agent.store.manifest import (
    DRAFT_NAME,
    ID_PATTERN,
    MANIFEST_NAME,
    SEALED_NAME,
    ImageFile,
    Manifest,
    SnapshotKind,
)

TMP_PREFIX = ".tmp-"
# Files CRIU itself writes into an image directory on each restore; not image content.
RESTORE_LEFTOVERS = frozenset({"stats-restore"})
QUARANTINE = ".quarantine"
# In a quarantined directory: why, in words (QUARANTINED) and as a record (QUARANTINED.json).
QUARANTINE_NOTE = "QUARANTINED"
QUARANTINE_RECORD = "QUARANTINED.json"
# Hashing threads: hashlib and pread release the GIL, so these use that many cores.
HASH_WORKERS = min(32, os.cpu_count() or 1)


@dataclass(frozen=True)
class Verdict:
    """The result of checking one snapshot: ok, or every reason it is refused."""

    id: str
    reasons: tuple[str, ...]
    manifest: Manifest | None = None
    # Bytes read and hashed; less than the image when unchanged files were trusted.
    hashed_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Skipped:
    """A snapshot `select` passed over, and why."""

    id: str
    refusal: Refusal

    @property
    def corrupt(self) -> bool:
        """Its files no longer verify against the manifest: it is never usable again, so
        the caller moves it to quarantine (stale or older ones may serve another day)."""
        return self.refusal.code is RefusalCode.CORRUPT


@dataclass(frozen=True)
class Selection:
    """What `select` chose (None: nothing usable, cold start) and why it skipped the others."""

    chosen: Manifest | None
    skipped: tuple[Skipped, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One published snapshot as `list` shows it, without reading its images."""

    id: str
    manifest: Manifest | None
    problem: Refusal | None
    bytes_on_disk: int


@dataclass(frozen=True)
class Quarantined:
    """One snapshot set aside in `<root>/.quarantine/<id>.<time>`, as `quarantined` lists it.

    `code` is the refusal's code as the caller gave it (corrupt, canary, restore_failed...);
    `reason` its words. A directory quarantined before the record existed, or by a version
    with a code this one does not know, has code None.
    """

    id: str
    path: Path
    manifest: Manifest | None
    code: RefusalCode | None
    reason: str
    quarantined_at: float
    bytes_on_disk: int


@dataclass(frozen=True)
class Retention:
    """What the store keeps (snapshots.keep, disk_budget_gib, quarantine_keep): after each
    publish the newest `keep` good snapshots within `budget_bytes`; after each quarantine or
    prune the quarantine's newest `quarantine_keep` within what the good ones leave. None
    leaves that part alone.

    Example::

        SnapshotStore(root, retention=Retention(keep=2, budget_bytes=64 << 30,
                                                quarantine_keep=2))
    """

    keep: int | None
    budget_bytes: int
    quarantine_keep: int | None = None

    @classmethod
    def of(cls, snaps: SnapshotsConfig) -> Retention:
        """From snapshots.keep, disk_budget_gib and quarantine_keep."""
        return cls(keep=snaps.keep, budget_bytes=int(snaps.disk_budget_gib * 2**30),
                   quarantine_keep=snaps.quarantine_keep)


@dataclass
class Draft:
    """A snapshot being built in `<root>/.tmp-<id>`; invisible until `publish`.

    With `in_place` it is built under its final name, `<root>/<id>`, kept invisible by a
    `.draft` file whose removal publishes it (for a backend whose image records its own
    path, which a rename would break).

    Example::

        with store.begin("full") as draft:
            run_criu_dump(into=draft.dir)
            draft.publish(make_manifest(draft.id, draft.seal()))
    """

    store: SnapshotStore
    id: str
    kind: SnapshotKind
    dir: Path
    chunk_bytes: int = CHUNK_BYTES
    in_place: bool = False
    published: bool = field(default=False, init=False)
    # What each file looked like when seal() hashed it (stat_key), written at publish.
    sealed: dict[str, list[int]] = field(default_factory=dict, init=False)

    def _image_names(self, scratch: tuple[str, ...]) -> list[str]:
        files, odd = walk_files(self.dir)
        if odd:
            raise SnapshotError(f"{self.dir / odd[0]}: the image holds something other than "
                                "a file or directory")
        skip = {*scratch, DRAFT_NAME}
        return [n for n in files if n not in skip]

    def seal(self, scratch: tuple[str, ...] = ()) -> tuple[ImageFile, ...]:
        """Make every image file private and durable; return their sizes and checksums.
        `scratch` names files the backend rewrites at each restore: left out."""
        names = self._image_names(scratch)
        for name in names:
            path = self.dir / name
            os.chmod(path, FILE_MODE)
            fsync_file(path)
            # Taken before hashing: a write during or after it moves ctime off this record,
            # so that file is hashed again at verify.
            self.sealed[name] = stat_key(os.lstat(path))
        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            digests = chunk_digests(self.dir, names, pool, self.chunk_bytes)
        return tuple(
            ImageFile(name=n, size=size, sha256_chunks=chunks)
            for n, (size, chunks) in digests.items()
        )

    def publish(self, manifest: Manifest) -> Path:
        """Write the manifest, then rename the directory into place: only now is it visible."""
        if manifest.id != self.id or manifest.kind != self.kind:
            raise SnapshotError(
                f"manifest {manifest.id}/{manifest.kind} is not for draft {self.id}"
            )
        on_disk = set(self._image_names(manifest.scratch))
        listed = {f.name for f in manifest.files}
        if on_disk != listed:
            raise SnapshotError(
                f"draft {self.dir}: files {sorted(on_disk ^ listed)} are not both on disk and in "
                "the manifest; call seal() after the last write"
            )
        write_private(self.dir / MANIFEST_NAME, manifest.model_dump_json(indent=1).encode())
        # The files as seal() hashed them: a later verify may trust a file that still has
        # the same inode, size, mtime and ctime (any write through the kernel changes ctime).
        # Each record also names the checksums the manifest gives the file: a manifest edited
        # afterwards (a flipped digest) no longer matches it, and the file is hashed again.
        sealed = {f.name: [*self.sealed[f.name], chunks_key(f.sha256_chunks)]
                  for f in manifest.files if f.name in self.sealed}
        write_private(self.dir / SEALED_NAME, json.dumps(sealed).encode())
        final = self.store.path(self.id)
        if self.in_place:
            os.unlink(self.dir / DRAFT_NAME)
            fsync_dir(self.dir)
        else:
            os.rename(self.dir, final)
            fsync_dir(self.store.root)
        self.published = True
        return final

    def abort(self) -> None:
        """Remove the draft; the previous snapshots are untouched."""
        if self.published:
            return
        if self.in_place:
            self.store._vanish(self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


class SnapshotStore:
    """One directory per snapshot under `root` (0700, manifest 0600).

    Example::

        store = SnapshotStore(Path("/var/lib/pitstop/snapshots"))
        store.open(clean=True)            # at agent start: create/check root, drop stale drafts
        sel = store.select(host_identity)
        if sel.chosen is None: ...        # cold start; sel.skipped says why each was refused
    """

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time,
                 trust_sealed: bool = True, retention: Retention | None = None) -> None:
        self.root = Path(root)
        self._clock = clock
        # select(): skip hashing files unchanged since seal (snapshots.verify: changed).
        self.trust_sealed = trust_sealed
        # None: nothing is pruned unless asked (prune, prune_quarantine). A reload replaces it.
        self.retention = retention

    def reconfigure(self, config: Config) -> None:
        """snapshots.keep, disk_budget_gib, quarantine_keep and verify, as a reload left
        them: whichever backend publishes into the store next is pruned by them."""
        self.retention = Retention.of(config.snapshots)
        self.trust_sealed = config.snapshots.verify == "changed"

    # --- layout -------------------------------------------------------------------

    def open(self, *, clean: bool = False) -> None:
        """Create or check the root; with `clean`, remove drafts left by a killed writer
        (only the one agent that owns the store may do that, at its start)."""
        make_private_dir(self.root)
        if clean:
            for name in os.listdir(self.root):
                if name.startswith(TMP_PREFIX):
                    shutil.rmtree(self.root / name, ignore_errors=True)
                elif ID_PATTERN.match(name) and _is_draft(self.root / name):
                    self._vanish(self.root / name)

    def _vanish(self, d: Path) -> None:
        """Remove a directory so that it disappears at once: renamed to a draft name first."""
        doomed = self.root / f"{TMP_PREFIX}deleted-{d.name}"
        os.rename(d, doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def path(self, snapshot_id: str) -> Path:
        if not ID_PATTERN.match(snapshot_id):
            raise SnapshotError(
                f"{snapshot_id!r} is not a snapshot id (see `pitstop snapshot list`)"
            )
        return self.root / snapshot_id

    def ids(self) -> list[str]:
        """Published snapshot ids; drafts and the quarantine (dot names) are never listed.
        A root that does not exist yet holds none."""
        if not os.path.lexists(self.root):
            return []
        check_root(self.root)
        return sorted(n for n in os.listdir(self.root)
                      if ID_PATTERN.match(n) and not _is_draft(self.root / n))

    def new_id(self, kind: SnapshotKind) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        return f"{stamp}-{kind}-{secrets.token_hex(3)}"

    @contextmanager
    def begin(self, kind: SnapshotKind, *, in_place: bool = False,
              snapshot_id: str | None = None) -> Iterator[Draft]:
        """A draft directory; removed on any exception or when left unpublished. With
        `in_place`, under its final name (see Draft). `snapshot_id` keeps the id a snapshot
        already has (one pulled from a remote store); by default a new one."""
        self.open()
        if snapshot_id is None:
            snapshot_id = self.new_id(kind)
        elif os.path.lexists(self.path(snapshot_id)):
            raise SnapshotError(f"snapshot {snapshot_id} is already in {self.root}")
        tmp = self.root / f"{TMP_PREFIX}{snapshot_id}"
        os.mkdir(tmp, DIR_MODE)
        if in_place:
            # Marked before it takes its final name: never seen there without the mark.
            write_private(tmp / DRAFT_NAME, b"")
            os.rename(tmp, self.root / snapshot_id)
            fsync_dir(self.root)
            tmp = self.root / snapshot_id
        draft = Draft(self, snapshot_id, kind, tmp, in_place=in_place)
        try:
            yield draft
        finally:
            draft.abort()

    # --- reading ------------------------------------------------------------------

    def load(self, snapshot_id: str) -> Manifest:
        """The parsed manifest, after checking the directory and file are private to us.

        Raises SnapshotUnusableError, whose `refusal` says why it cannot be read."""
        d = self.path(snapshot_id)

        def unusable(code: RefusalCode, detail: str) -> SnapshotUnusableError:
            return SnapshotUnusableError(Refusal(code, detail))

        if not os.path.lexists(d):
            raise unusable(RefusalCode.NOT_FOUND, f"no snapshot {snapshot_id} in {self.root}; "
                           "`pitstop snapshot list` shows them")
        problem = check_private_dir(d)
        if problem:
            raise unusable(RefusalCode.PERMISSIONS,
                           f"snapshot {snapshot_id}: directory {d} {problem}")
        try:
            raw = read_private(d / MANIFEST_NAME)
        except FileNotFoundError as e:
            raise unusable(RefusalCode.UNREADABLE,
                           f"snapshot {snapshot_id}: no {MANIFEST_NAME}") from e
        except SnapshotError as e:
            # read_private refuses a manifest that is not private (owner, mode).
            raise unusable(RefusalCode.PERMISSIONS, str(e)) from e
        except OSError as e:
            raise unusable(RefusalCode.UNREADABLE,
                           f"snapshot {snapshot_id}: cannot read manifest: {e}") from e
        try:
            m = Manifest.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(document)"
            raise unusable(
                RefusalCode.UNREADABLE,
                f"snapshot {snapshot_id}: manifest is invalid or truncated at {where}: "
                f"{first['msg']}"
            ) from None
        if m.id != snapshot_id:
            raise unusable(RefusalCode.UNREADABLE,
                           f"snapshot {snapshot_id}: manifest names another id ({m.id})")
        return m

    def entries(self, *, sized: bool = True) -> list[Entry]:
        """Every published snapshot, newest first, with any problem found without hashing.
        `sized=False` leaves `bytes_on_disk` 0: select needs no sizes, and walking every
        file of every image is milliseconds of each restore."""
        out = []
        for sid in self.ids():
            d = self.root / sid
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                # A stray file with a snapshot-like name (a filler, a note): listed as a
                # problem, never read as a snapshot, and it must not stop the listing.
                out.append(Entry(sid, None, Refusal(
                    RefusalCode.NOT_A_SNAPSHOT,
                    f"{d} is not a snapshot directory; move it out of {self.root}"), 0))
                continue
            size = tree_bytes(d) if sized else 0
            try:
                out.append(Entry(sid, self.load(sid), None, size))
            except SnapshotUnusableError as e:
                out.append(Entry(sid, None, e.refusal, size))
        return sorted(out, key=_created, reverse=True)

    def verify(self, snapshot_id: str, *, full: bool = True,
               manifest: Manifest | None = None) -> Verdict:
        """Check manifest, permissions, and the size and sha256 chunks of every image file.
        With `full=False`, a file whose inode, size, mtime and ctime are still those it had
        when it was hashed at seal is trusted without being read again. `manifest`: the one
        the caller loaded a moment ago (select), not read and parsed again."""
        if manifest is not None:
            m = manifest
        else:
            try:
                m = self.load(snapshot_id)
            except SnapshotError as e:
                return Verdict(snapshot_id, (str(e),))
        d = self.path(snapshot_id)
        listed = {f.name for f in m.files}
        reasons = unlisted_files(d, listed, listed | {MANIFEST_NAME, SEALED_NAME}
                                 | RESTORE_LEFTOVERS | set(m.scratch))
        sealed = {} if full else self._sealed(d)
        to_hash = []
        for f in m.files:
            st, why = private_file(d / f.name, f.size)
            if st is None:
                reasons.append(why)
            elif sealed.get(f.name) != [*stat_key(st), chunks_key(f.sha256_chunks)]:
                to_hash.append(f)
        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            digests = chunk_digests(d, [f.name for f in to_hash], pool, m.chunk_bytes)
        for f in to_hash:
            why = chunks_differ(d / f.name, f.sha256_chunks, digests[f.name][1], m.chunk_bytes)
            if why:
                reasons.append(why)
        return Verdict(snapshot_id, tuple(reasons), m, sum(f.size for f in to_hash))

    def _sealed(self, d: Path) -> dict[str, list[int]]:
        # Missing or unreadable (a snapshot from before sealed.json, a bad file): hash all.
        try:
            raw = json.loads(read_private(d / SEALED_NAME))
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def select(self, identity: Identity, kind: SnapshotKind | None = None,
               accept: Callable[[Manifest], Skipped | None] | None = None,
               remapped: Collection[str] = frozenset()) -> Selection:
        """The newest snapshot (of `kind`, if given) whose identity equals `identity` but for
        the `remapped` fields (which the restoring backend puts right), that `accept` (the
        backend's own check) does not refuse, and which verifies; every other one is named in
        `skipped` with its refusal.

        It hashes image files: call it from a worker thread, never on the event loop."""
        skipped: list[Skipped] = []
        chosen: Manifest | None = None

        def skip(sid: str, code: RefusalCode, detail: str) -> None:
            skipped.append(Skipped(sid, Refusal(code, detail)))

        for e in self.entries(sized=False):
            if e.manifest is None:
                assert e.problem is not None
                skipped.append(Skipped(e.id, e.problem))
            elif chosen is not None:
                skip(e.id, RefusalCode.SUPERSEDED, f"older than the chosen {chosen.id}")
            elif kind is not None and e.manifest.kind != kind:
                skip(e.id, RefusalCode.WRONG_KIND, f"kind {e.manifest.kind}, wanted {kind}")
            elif diffs := compare(e.manifest.identity, identity, remapped):
                skip(e.id, RefusalCode.STALE, describe(diffs, brief=True))
            elif accept is not None and (refused := accept(e.manifest)) is not None:
                skipped.append(refused)
            else:
                v = self.verify(e.id, full=not self.trust_sealed, manifest=e.manifest)
                if v.ok:
                    chosen = v.manifest
                else:
                    skip(e.id, RefusalCode.CORRUPT, "; ".join(v.reasons))
        return Selection(chosen, tuple(skipped))

    # --- removing -----------------------------------------------------------------

    def quarantine(self, snapshot_id: str, reason: str,
                   code: RefusalCode | None = None) -> Path:
        """Move a snapshot aside for inspection; it is never selected again. With a
        `retention`, the quarantine is pruned to it afterwards."""
        src = self.path(snapshot_id)
        qdir = self.root / QUARANTINE
        qdir.mkdir(mode=DIR_MODE, exist_ok=True)
        now = self._clock()
        dst = qdir / f"{snapshot_id}.{int(now)}"
        os.rename(src, dst)
        fsync_dir(self.root)
        write_private(dst / QUARANTINE_NOTE, (reason.rstrip("\n") + "\n").encode())
        write_private(dst / QUARANTINE_RECORD, json.dumps(
            {"code": code.value if code else "", "reason": reason,
             "quarantined_at": now}).encode())
        self._bound_quarantine()
        return dst

    def _bound_quarantine(self) -> None:
        r = self.retention
        if r is not None and r.quarantine_keep is not None:
            self.prune_quarantine(r.quarantine_keep, r.budget_bytes)

    def quarantined(self) -> list[Quarantined]:
        """Every quarantined snapshot, newest first; never selected, only listed."""
        qdir = self.root / QUARANTINE
        if not os.path.isdir(qdir) or os.path.islink(qdir):
            return []
        out = []
        for name in os.listdir(qdir):
            d = qdir / name
            sid, _, stamp = name.rpartition(".")
            if not sid or not stamp.isdigit() or not stat.S_ISDIR(os.lstat(d).st_mode):
                continue
            record = _quarantine_record(d)
            manifest = None
            # Quarantined for being unreadable, perhaps: listed all the same.
            with contextlib.suppress(OSError, ValueError, SnapshotError):
                manifest = Manifest.model_validate_json(read_private(d / MANIFEST_NAME))
            out.append(Quarantined(
                id=sid, path=d, manifest=manifest, code=_known_code(record.get("code")),
                reason=str(record.get("reason", "")),
                quarantined_at=float(record.get("quarantined_at", stamp)),
                bytes_on_disk=tree_bytes(d)))
        return sorted(out, key=lambda q: (q.quarantined_at, q.path.name), reverse=True)

    def prune_quarantine(self, keep: int, budget_bytes: int) -> list[Path]:
        """Keep the newest `keep` quarantined snapshots while they fit in `budget_bytes`
        beside the published ones (which come first); delete the others."""
        room = budget_bytes - sum(e.bytes_on_disk for e in self.entries())
        doomed = []
        for i, q in enumerate(self.quarantined()):
            if i < keep and q.bytes_on_disk <= room:
                room -= q.bytes_on_disk
            else:
                doomed.append(q.path)
        for d in doomed:
            gone = self.root / f"{TMP_PREFIX}deleted-q-{d.name}"
            os.rename(d, gone)
            shutil.rmtree(gone, ignore_errors=True)
        if doomed:
            fsync_dir(self.root / QUARANTINE)
        return doomed

    def delete(self, snapshot_id: str) -> None:
        """Remove a snapshot: first renamed to a draft name, so it vanishes atomically."""
        src = self.path(snapshot_id)
        if not src.is_dir() or src.is_symlink():
            raise SnapshotError(f"no snapshot {snapshot_id} in {self.root}")
        doomed = self.root / f"{TMP_PREFIX}deleted-{snapshot_id}"
        os.rename(src, doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed)

    def prune(self, keep: int, budget_bytes: int) -> list[str]:
        """Keep the newest `keep` good snapshots that fit in `budget_bytes`, delete the other
        good ones; the newest good one is always kept. Broken ones are left to quarantine."""
        good = [e for e in self.entries() if e.manifest is not None]
        doomed, kept_bytes = [], 0
        for i, e in enumerate(good):
            assert e.manifest is not None
            size = e.manifest.image_bytes
            if i == 0 or (i < keep and kept_bytes + size <= budget_bytes):
                kept_bytes += size
            else:
                doomed.append(e.id)
        for sid in doomed:
            self.delete(sid)
        # What the published ones now take leaves the quarantine less (or more) room.
        self._bound_quarantine()
        return doomed


def _is_draft(d: Path) -> bool:
    return os.path.lexists(d / DRAFT_NAME)


def _quarantine_record(d: Path) -> dict:
    try:
        raw = json.loads(read_private(d / QUARANTINE_RECORD))
    except (OSError, ValueError, SnapshotError):
        # Quarantined before the record existed: the note holds the words.
        try:
            return {"reason": read_private(d / QUARANTINE_NOTE).decode(errors="replace").strip()}
        except (OSError, SnapshotError):
            return {}
    return raw if isinstance(raw, dict) else {}


def _created(e: Entry) -> tuple[float, str]:
    # Unreadable ones sort oldest; ties (same second) fall back to the id.
    return (e.manifest.created_at.timestamp() if e.manifest else 0.0, e.id)


def _known_code(value: object) -> RefusalCode | None:
    try:
        return RefusalCode(value)
    except ValueError:
        return None


