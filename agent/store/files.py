"""Atomic private files and trusted directories: the only way the store writes to disk."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

from agent.errors import SnapshotError

# Re-exported: the store writes only through this module.
from agent.fsutil import fsync_dir as fsync_dir
from agent.fsutil import write_private as write_private

DIR_MODE = 0o700
FILE_MODE = 0o600


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) with mode 0700, or check the existing one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    check_root(path)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read without following symlinks."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
