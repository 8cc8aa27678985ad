"""Atomic, private file writes (a reader sees the old file or the whole new one), and reads of
files only we may have written."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    _fsync(path, os.O_DIRECTORY)


def fsync_file(path: Path) -> None:
    _fsync(path, os.O_NOFOLLOW)


def write_private(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write `data` to `path` through a temporary file, fsync, rename, fsync the directory.

    `durable=False` skips both fsyncs, for a file that means nothing after a reboot (it
    stays atomic: a reader still sees the old file or the whole new one).
    """
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make sure it is 0700 and ours."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.lstat()
    if st.st_uid != os.getuid():
        from agent.errors import PitstopError

        raise PitstopError(f"{path} is owned by uid {st.st_uid}, not by us; fix its owner")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def read_owned(path: Path, what: str, limit: int | None = None) -> bytes | None:
    """The bytes of `path` (None when there is none), read only when the file is ours (or
    root's) and nobody else may write it: whoever can write such a file decides what the
    agent does with it. ModelError naming `what` otherwise, or past `limit` bytes."""
    from agent.errors import ModelError

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelError(f"{path}: cannot open {what}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
            raise ModelError(f"{path}: owned by uid {st.st_uid} with mode "
                             f"{st.st_mode & 0o777:o}; it must be ours and not writable by "
                             "others: remove it (Pitstop writes a new one)")
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ModelError(f"{path}: more than {limit} bytes: not {what}")
    return data
