"""What a tree keeps outside itself (shared memory files, socket paths): saved, put back, swept."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.errors import SnapshotError

SHM_DIR = Path("/dev/shm")
# Image files saved by the post-dump script are named PREFIX + their name in the shm dir.
PREFIX = "outside."
# CRIU's name for the link it makes to an open but deleted file (--link-remap).
REMAP = "link_remap."
_DELETED = " (deleted)"

# A file as the kernel knows it, (st_dev, st_ino): a name in the shm dir may name another file
# later (a restore writes its own copy under the name a dead tree used).
FileId = tuple[int, int]


@dataclass(frozen=True)
class Survey:
    """Files of the shm dir the tree maps or holds open, and the paths its Unix sockets bind.

    vLLM's engine core and workers talk through POSIX shared memory (`/dev/shm/psm_*`, a
    ring buffer) and multiprocessing semaphores (`/dev/shm/sem.*`, some already unlinked),
    and the API server and the engine core through ZeroMQ `ipc://` sockets bound in /tmp.
    CRIU keeps none of these in the image: it records a shared mapping of a file by path
    (the content lives in the file, which the running tree goes on changing after a
    `--leave-running` dump), links an unlinked one back as `link_remap.N` only until the
    dump ends, and re-binds a socket path only if no file is there.
    """

    shm_files: tuple[str, ...]
    socket_paths: tuple[str, ...]


def _linked(path: str) -> str | None:
    return None if path.endswith(_DELETED) else path


def _shm_maps(maps: Path, top: str) -> Iterator[tuple[str, str, str, str]]:
    """(permissions, device, inode, path) of each mapping in the `maps` file of a file
    directly in the shm dir `top` (its path may end in " (deleted)"); none if it is gone."""
    with contextlib.suppress(OSError):
        for line in maps.read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            if path.startswith(top) and "/" not in path.removesuffix(_DELETED)[len(top):]:
                yield parts[1], parts[3], parts[4], path


def survey(pids: tuple[int, ...], proc_root: Path = Path("/proc"),
           shm_dir: Path = SHM_DIR) -> Survey:
    """What the tree `pids` uses outside itself, read from /proc (maps, fds, net/unix)."""
    shm: set[str] = set()
    inodes: set[int] = set()
    top = f"{shm_dir}/"
    for pid in pids:
        base = proc_root / str(pid)
        for _perms, _dev, _ino, path in _shm_maps(base / "maps", top):
            if (name := _linked(path)) is not None:
                shm.add(name[len(top):])
        with contextlib.suppress(OSError):
            for fd in os.listdir(base / "fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(base / "fd" / fd)
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
                    elif (name := _linked(target)) and name.startswith(top) \
                            and "/" not in name[len(top):]:
                        shm.add(name[len(top):])
    paths: set[str] = set()
    if pids:
        with contextlib.suppress(OSError):
            for line in (proc_root / str(pids[0]) / "net" / "unix").read_text().splitlines()[1:]:
                f = line.split()
                # Abstract names start with '@' and leave no file behind.
                if len(f) >= 8 and int(f[6]) in inodes and f[7].startswith("/"):
                    paths.add(f[7])
    return Survey(tuple(sorted(shm)), tuple(sorted(paths)))


def shared_files(pids: tuple[int, ...], proc_root: Path = Path("/proc"),
                 shm_dir: Path = SHM_DIR) -> dict[FileId, str]:
    """The files directly in `shm_dir` that the tree `pids` maps shared and writable, each
    with its name there: vLLM's ring buffers and semaphores. A file the tree only reads (a
    model copied into /dev/shm) is never one.

    The name is "" for a file mapped only under a name since unlinked: glibc's sem_open maps
    a semaphore under a temporary name, links the file under `sem.<name>`, then unlinks the
    temporary one (the mapping says "(deleted)"); a process that opened it by name maps the
    name, which then wins."""
    found: dict[FileId, str] = {}
    top = f"{shm_dir}/"
    for pid in pids:
        for perms, dev, ino, path in _shm_maps(proc_root / str(pid) / "maps", top):
            if perms[1] != "w" or perms[3] != "s":
                continue
            major, minor = (int(x, 16) for x in dev.split(":"))
            ident = (os.makedev(major, minor), int(ino))
            if not found.get(ident):
                found[ident] = "" if path.endswith(_DELETED) else path[len(top):]
    return found


@dataclass(frozen=True)
class Swept:
    """What `sweep` removed: the names, and the memory they held (their allocated blocks:
    vLLM's ring buffers are mostly holes)."""

    names: tuple[str, ...]
    bytes: int


def sweep(dead: dict[FileId, str], live: dict[FileId, str], shm_dir: Path = SHM_DIR) -> Swept:
    """Unlink each plain file directly in `shm_dir` that is one of `dead` (the files of a tree
    that is gone, from `shared_files`) and not one of `live` (the tree serving now).

    By identity first: a restore puts its own copies back under the dead tree's names (new
    files, kept), and a semaphore's file is mapped under a name it no longer has. Then by
    name, where the tree mapped one: a file system that hands a freed inode number to a new
    file (tmpfs does not) cannot make another file look like the dead one. Holds
    `remap_window`, which `put_back` holds too: no file is replaced between its check and its
    unlink. A file gone already is no error."""
    doomed = {ident: name for ident, name in dead.items() if ident not in live}
    if not doomed:
        return Swept((), 0)
    with remap_window(shm_dir):
        return _unlink_each(doomed, shm_dir)


def _unlink_each(doomed: dict[FileId, str], shm_dir: Path) -> Swept:
    """Unlink the plain files of `shm_dir` that are one of `doomed`, under the name it gives
    (any name where it gives ""). The caller holds `remap_window`."""
    names: list[str] = []
    size = 0
    for name in sorted(_names(shm_dir)):
        try:
            st = os.lstat(shm_dir / name)
            if not stat.S_ISREG(st.st_mode) or name == REMAP_LOCK \
                    or doomed.get((st.st_dev, st.st_ino)) not in ("", name):
                continue
            os.unlink(shm_dir / name)
        except FileNotFoundError:
            continue
        names.append(name)
        size += st.st_blocks * 512
    return Swept(tuple(names), size)


def post_dump_script(script: Path, survey: Survey, image_dir: Path,
                     shm_dir: Path = SHM_DIR) -> None:
    """Write the `criu dump --action-script` that copies the shm files into the image.

    CRIU runs it at post-dump, while the tree is still frozen: the copies are the content
    the dumped pages expect, before the tree (left running) changes them again. The
    link_remap files this dump made are copied too: CRIU removes them when the tree is
    left running, and a restore needs them."""
    before = {n for n in _names(shm_dir) if n.startswith(REMAP)}
    q = shlex.quote
    lines = [
        "#!/bin/sh",
        "# Written by Pitstop for one CRIU dump: save what the tree keeps in the shm dir.",
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0',
        "set -e",
        f"cd {q(str(shm_dir))}",
    ]
    for name in survey.shm_files:
        lines.append(f"cp -p -- {q(name)} {q(str(image_dir / (PREFIX + name)))}")
    lines += [
        f"for f in {REMAP}*; do",
        '    [ -f "$f" ] || continue',
        '    case " ' + " ".join(sorted(before)) + ' " in *" $f "*) continue ;; esac',
        f'    cp -p -- "$f" {q(str(image_dir))}/{PREFIX}"$f"',
        "done",
    ]
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o700)


def saved(image_dir: Path) -> tuple[str, ...]:
    """The shm names the post-dump script saved into `image_dir`."""
    return tuple(sorted(n[len(PREFIX):] for n in _names(image_dir) if n.startswith(PREFIX)))


def put_back(image_dir: Path, names: tuple[str, ...], socket_paths: tuple[str, ...],
             shm_dir: Path = SHM_DIR) -> dict[FileId, str]:
    """Before a restore: each saved shm file in place again (the dump-time content, written
    whole then renamed), and every stale socket file at a path the tree binds removed.
    Returns the copies written, by identity, with their names (CRIU consumes the link_remap
    ones); should the restore fail, the caller gives them to `take_back`. Called inside
    `remap_window`, as `take_back` is; on an error it takes back what it wrote."""
    copies: dict[FileId, str] = {}
    try:
        for name in names:
            target = shm_dir / name
            tmp = shm_dir / f".pitstop-{os.getpid()}-{name}"
            try:
                copy_sparse(image_dir / (PREFIX + name), tmp)
                st = os.lstat(tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            copies[(st.st_dev, st.st_ino)] = name
    except OSError as e:
        with contextlib.suppress(OSError):  # the error to report is the one above
            take_back(copies, shm_dir)
        raise SnapshotError(f"could not put {name} back into {shm_dir} before the restore: "
                            f"{e}; check that {shm_dir} is writable and has room") from e
    for path in socket_paths:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                # Left by the dead tree; CRIU's bind of the same path would fail on it.
                os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            with contextlib.suppress(OSError):
                take_back(copies, shm_dir)
            raise SnapshotError(f"could not remove the stale socket {path} that the restored "
                                f"engine binds again: {e}") from e
    return copies


def take_back(copies: dict[FileId, str], shm_dir: Path = SHM_DIR) -> Swept:
    """After a restore that failed (in CRIU, or after it, its tree killed): unlink the copies
    `put_back` wrote that are still there under their names. Nobody else would: they are not
    the dead tree's files, which the next ready engine sweeps, and a cold start after the
    failure names its own. A copy replaced since (another restore of the image on this host)
    is not one. The caller holds `remap_window`."""
    return _unlink_each(copies, shm_dir) if copies else Swept((), 0)


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy only the data of `src` (vLLM's 160-250 MB ring buffers are mostly holes): the
    copy in /dev/shm costs the memory the original did, not its apparent size."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        os.fchmod(fout.fileno(), stat.S_IMODE(os.fstat(fin.fileno()).st_mode))
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            # pread/pwrite: copy_file_range refuses a copy from the image's filesystem to
            # tmpfs (EXDEV).
            while start < end:
                chunk = os.pread(fin.fileno(), min(end - start, 1 << 20), start)
                if not chunk:
                    break
                os.pwrite(fout.fileno(), chunk, start)
                start += len(chunk)
            pos = end
        os.ftruncate(fout.fileno(), size)


def drop_stale_remaps(tree: tuple[int, ...], shm_dir: Path = SHM_DIR,
                      proc_root: Path = Path("/proc")) -> tuple[str, ...]:
    """Before a dump of `tree`: remove the link_remap.N files in `shm_dir` that no process
    outside `tree` maps or holds open.

    CRIU names them after the file's id in the dump, so the next dump picks the same name;
    one left by a CRIU that was killed mid-dump fails every later dump ("Can't link ...
    link_remap.N: File exists"). Another tree's dump under way keeps its own: that frozen
    tree still maps the file its link_remap points at. One that only `tree` holds is left
    from an earlier dump of it, as the agent never runs two dumps of one tree at once."""
    candidates = _remap_files(shm_dir)
    if not candidates:
        return ()
    inodes = {ino for _, ino in candidates}
    mine = {str(p) for p in tree}
    held: set[tuple[int, int]] = set()
    for pid in _names(proc_root):
        if pid.isdigit() and pid not in mine:
            held |= _held_by(proc_root / pid, inodes)
    dropped = []
    for key, name in candidates.items():
        if key not in held:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_dir / name)
                dropped.append(name)
    return tuple(sorted(dropped))


def _remap_files(shm_dir: Path) -> dict[tuple[int, int], str]:
    """{(device, inode): name} of the link_remap.N files in `shm_dir`."""
    found: dict[tuple[int, int], str] = {}
    for name in _names(shm_dir):
        if name.startswith(REMAP):
            with contextlib.suppress(OSError):
                st = os.lstat(shm_dir / name)
                if stat.S_ISREG(st.st_mode):
                    found[(st.st_dev, st.st_ino)] = name
    return found


def _held_by(proc: Path, inodes: set[int]) -> set[tuple[int, int]]:
    """(device, inode) of what the process at `proc` (/proc/PID) maps among `inodes`, and
    of every file it holds open; nothing when it is gone or not ours to read."""
    held: set[tuple[int, int]] = set()
    with contextlib.suppress(OSError):
        for line in (proc / "maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) >= 5 and parts[4].isdigit() and int(parts[4]) in inodes:
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                held.add((os.makedev(major, minor), int(parts[4])))
    with contextlib.suppress(OSError):
        for fd in os.listdir(proc / "fd"):
            with contextlib.suppress(OSError):
                st = os.stat(proc / "fd" / fd)
                held.add((st.st_dev, st.st_ino))
    return held


# Every agent on the host takes it around a dump and around a restore (put back, CRIU,
# cleanup): CRIU names its links to deleted files after the file's id in the image, so two
# vLLM trees dumped or restored at once on one host would use the same link_remap.N. A sweep
# of a dead tree's files takes it too: no put_back replaces a file between the sweep's check
# of it and its unlink.
REMAP_LOCK = ".pitstop-link-remap.lock"


@contextlib.contextmanager
def remap_window(shm_dir: Path = SHM_DIR) -> Iterator[float]:
    """Hold the host-wide lock on `shm_dir`'s link_remap names (blocking; flock(2)); yields
    the seconds spent waiting for it (another engine's dump or restore on this host).

    Example::

        with remap_window() as waited_s:
            criu.dump(...)
    """
    try:
        fd = os.open(shm_dir / REMAP_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise SnapshotError(f"cannot open {shm_dir / REMAP_LOCK}: {e.strerror}; "
                            f"{shm_dir} must be writable by the agent") from e
    try:
        t0 = time.monotonic()
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.monotonic() - t0
    finally:
        os.close(fd)  # releases the lock


def _names(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []
