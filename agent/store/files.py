"""Atomic private files and trusted directories: the only way the store writes to disk."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

from agent.errors import SnapshotError

# Re-exported: the store writes only through this module.
from agent.fsutil import fsync_dir as fsync_dir
from agent.fsutil import fsync_file as fsync_file
from agent.fsutil import write_private as write_private

DIR_MODE = 0o700
FILE_MODE = 0o600


def read_private(path: Path, limit: int = 16 << 20) -> bytes:
    """Read a file the store wrote, refusing a symlink, a foreign owner or a loose mode."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        problem = _loose(st, FILE_MODE)
        if problem:
            raise SnapshotError(f"{path}: {problem}")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _loose(st: os.stat_result, mode: int) -> str | None:
    """Why a file or directory is not private to us, or None."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & ~mode:
        return f"mode {stat.S_IMODE(st.st_mode):o} is looser than {mode:o}; chmod {mode:o} it"
    return None


def check_private_dir(path: Path) -> str | None:
    """Why `path` is not a private directory of ours (symlink, owner, mode), or None."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot stat: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return _loose(st, DIR_MODE)


def check_root(path: Path) -> None:
    """Refuse a store root that is a symlink, not ours, or group/world-writable, and any
    parent that someone else could swap (a symlink, or writable by others without sticky)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise SnapshotError(f"snapshot directory {path}: cannot stat: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode):
        raise SnapshotError(
            f"snapshot directory {path} is a symlink; point paths.snapshot_dir at a real directory"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise SnapshotError(f"snapshot directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise SnapshotError(
            f"snapshot directory {path} is owned by uid {st.st_uid}, not by this user; "
            f"chown it to uid {os.geteuid()}"
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise SnapshotError(
            f"snapshot directory {path} is group- or world-writable "
            f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it"
        )
    for parent in path.parents:
        pst = os.lstat(parent)
        if stat.S_ISLNK(pst.st_mode):
            raise SnapshotError(f"snapshot directory {path}: parent {parent} is a symlink")
        # A sticky world-writable parent (/tmp) cannot have our entry swapped by others.
        if stat.S_IMODE(pst.st_mode) & 0o022 and not pst.st_mode & stat.S_ISVTX:
            raise SnapshotError(
                f"snapshot directory {path}: parent {parent} is writable by others "
                f"(mode {stat.S_IMODE(pst.st_mode):o}); chmod go-w it"
            )


def walk_files(directory: Path) -> tuple[list[str], list[str]]:
    """(regular files, anything else) under `directory`, as sorted paths relative to it.
    Symlinks are never followed: one (to a file or a directory) is "anything else"."""
    files, odd = [], []
    for top, dirs, names in os.walk(directory):
        rel = os.path.relpath(top, directory)
        for name in [*names, *dirs]:
            path = os.path.join(top, name)
            st = os.lstat(path)
            entry = name if rel == "." else f"{rel}/{name}"
            if stat.S_ISREG(st.st_mode):
                files.append(entry)
            elif not stat.S_ISDIR(st.st_mode):
                odd.append(entry)
    return sorted(files), sorted(odd)


def tree_bytes(directory: Path) -> int:
    """Bytes of the regular files under `directory` (symlinks not followed)."""
    total = 0
    for top, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(top, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) with mode 0700, or check the existing one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    check_root(path)


# Images are hashed in chunks so that one 14 GB pages file is checked by many cores at
# once (one sha256 stream runs at about 2 GB/s: as slow as the restore it guards); 16 MiB
# keeps even a 1.5 GB hybrid image spread over 16 cores (about 0.2 s at 64 MiB, measured).
CHUNK_BYTES = 16 << 20
_READ_BYTES = 4 << 20


def stat_key(st: os.stat_result) -> list[int]:
    """What changes whenever a file's content is written through the kernel: ctime cannot
    be set back by anyone, so a file with the same key was not written since."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def chunks_key(sha256_chunks: Sequence[str]) -> str:
    """One string for a file's chunk checksums, as a sealed record keeps it."""
    return hashlib.sha256(",".join(sha256_chunks).encode()).hexdigest()


def _hash_range(fd: int, offset: int, length: int) -> str:
    h = hashlib.sha256()
    pos, end = offset, offset + length
    while pos < end:
        block = os.pread(fd, min(_READ_BYTES, end - pos), pos)
        if not block:
            break  # the file shrank under us: the digest will not match
        h.update(block)  # hashlib releases the GIL for large blocks: threads run in parallel
        pos += len(block)
    return h.hexdigest()


def chunk_digests(
    directory: Path, names: list[str], pool: Executor, chunk: int = CHUNK_BYTES
) -> dict[str, tuple[int, tuple[str, ...]]]:
    """{name: (size, sha256 of each `chunk`-byte piece)} for files in `directory`, read
    without following symlinks, every piece of every file hashed in parallel on `pool`."""
    fds = {}
    try:
        jobs = {}
        for name in names:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW)
            fds[name] = fd
            size = os.fstat(fd).st_size
            offsets = range(0, max(size, 1), chunk)
            jobs[name] = (size, [pool.submit(_hash_range, fd, o, chunk) for o in offsets])
        return {n: (size, tuple(f.result() for f in fs)) for n, (size, fs) in jobs.items()}
    finally:
        for fd in fds.values():
            os.close(fd)


def private_file(p: Path, size: int) -> tuple[os.stat_result | None, str]:
    """`p`'s stat when it is a private regular file of `size` bytes, else None and why not."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None, f"{p}: missing"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{p}: not a regular file"
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return None, f"{p}: not private (uid {st.st_uid}, mode {st.st_mode & 0o777:o})"
    if st.st_size != size:
        return None, f"{p}: size {st.st_size}, manifest says {size}"
    return st, ""


def chunks_differ(p: Path, expected: Sequence[str], got: Sequence[str],
                  chunk_bytes: int) -> str:
    """Why the sha256 chunks `got` of `p` are not the manifest's `expected`; "" when they
    are. The first bad chunk is named by its byte offset."""
    if len(got) != len(expected):
        return f"{p}: the manifest's chunk list does not fit its size"
    bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    if bad:
        return (f"{p}: sha256 differs from the manifest in {len(bad)} chunk(s), the first at "
                f"byte {bad[0] * chunk_bytes}")
    return ""


def unlisted_files(d: Path, listed: set[str], known: set[str]) -> list[str]:
    """Why the files in `d` that are not `known` (the manifest's and the store's own) are
    wrong there, and the odd entries (not a regular file or directory) it does not list."""
    on_disk, odd = walk_files(d)
    reasons = [f"{d / extra}: not listed in the manifest" for extra in sorted(set(on_disk) - known)]
    reasons += [f"{d / name}: not a regular file or directory" for name in odd
                if name not in listed]
    return reasons
