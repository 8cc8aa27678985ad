"""The weights digest: a sha256 manifest of the model files the engine loads, stat-cached."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agent.errors import WeightsError
from agent.fsutil import write_private

log = logging.getLogger("pitstop.weights")

# What an engine reads from a model directory (vLLM and transformers read the top level
# only: a repository's `original/` copy of the weights is not loaded and not hashed).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
CONFIG_PATTERNS = (
    "*.json",  # config, generation_config, tokenizer(_config), special_tokens_map, *.index.json
    "tokenizer.model",  # sentencepiece
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",  # chat templates
    "*.py",  # trust_remote_code modelling code
)
PATTERNS = WEIGHT_PATTERNS + CONFIG_PATTERNS
CACHE_NAME = "weights-digest-cache.json"
CACHE_VERSION = 1
# A file changed less than this long before it was hashed is not cached: its timestamps
# could be unchanged by a write in the same timestamp tick (git's "racy clean" problem).
RACY_NS = 2_000_000_000
_BLOCK = 8 << 20
HASH_WORKERS = min(4, os.cpu_count() or 1)


def is_model_file(name: str) -> bool:
    """Whether the engine loads a top-level file of this name (hidden files never)."""
    return not name.startswith(".") and any(fnmatch.fnmatchcase(name, p) for p in PATTERNS)


@dataclass(frozen=True)
class FileDigest:
    """One hashed file: its name in the model directory, size and sha256 (as `sha256sum`)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class WeightsDigest:
    """The digest of one model directory and what computing it cost.

    Example::

        d = WeightsDigester(state_dir / CACHE_NAME).digest(model_dir)
        d.digest       # 'sha256:...' over the sorted (name, size, sha256) list
        d.bytes_read   # 0 when every file came from the cache
    """

    model: Path
    digest: str
    files: tuple[FileDigest, ...]
    bytes_read: int
    files_hashed: int
    seconds: float


def manifest_digest(files: tuple[FileDigest, ...]) -> str:
    """sha256 over one `name size sha256` line per file, sorted by name: any file added,
    removed, renamed or changed changes it."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        h.update(f"{f.name}\0{f.size}\0{f.sha256}\n".encode())
    return "sha256:" + h.hexdigest()


def stat_key(st: os.stat_result) -> list[int]:
    """What tells a file unchanged without reading it: size, mtime, ctime, inode, device."""
    # ctime cannot be set by a user process: a rewrite whose mtime was put back with
    # os.utime still changes it. ino/dev catch a file replaced by rename.
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class WeightsDigester:
    """Hashes a model directory, re-reading only files whose stat changed since last time.

    The cache (`cache_path`, 0600, written atomically) maps each file's real path to its
    (size, mtime_ns, ctime_ns, inode, device) and sha256. Thread-safe: the drift watcher
    calls it from a worker thread while the agent may call it too.

    Example::

        dg = WeightsDigester(Path("/var/lib/pitstop") / CACHE_NAME)
        dg.digest(model).digest               # hashes every file once, then stats only
        dg.digest(model, rehash=True)         # reads everything again (pitstop digest --rehash)
    """

    def __init__(
        self,
        cache_path: Path | None,
        *,
        racy_ns: int = RACY_NS,
        workers: int = HASH_WORKERS,
        clock_ns=time.time_ns,
    ) -> None:
        self.cache_path = cache_path
        self.racy_ns = racy_ns
        self.workers = workers
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self._cache: dict[str, dict] | None = None

    # --- the cache ------------------------------------------------------------------

    def _load(self) -> dict[str, dict]:
        if self._cache is not None:
            return self._cache
        self._cache = {}
        if self.cache_path is None:
            return self._cache
        try:
            fd = os.open(self.cache_path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return self._cache
        except OSError as e:
            log.warning("%s: cannot open the weights cache (%s); hashing everything",
                        self.cache_path, e.strerror)
            return self._cache
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            # Whoever can write the cache can make changed weights look unchanged.
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                log.warning("%s: not private to uid %d (uid %d, mode %o); ignoring it",
                            self.cache_path, os.geteuid(), st.st_uid, st.st_mode & 0o777)
                return self._cache
            try:
                data = json.loads(f.read())
                if data.get("version") == CACHE_VERSION and isinstance(data["entries"], dict):
                    self._cache = data["entries"]
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("%s: unreadable weights cache; hashing everything", self.cache_path)
        return self._cache

    def _save(self, entries: dict[str, dict]) -> None:
        if self.cache_path is None:
            return
        data = json.dumps({"version": CACHE_VERSION, "entries": entries}, sort_keys=True)
        try:
            write_private(self.cache_path, data.encode())
        except OSError as e:
            # A read-only state dir (`pitstop drift` as another user) costs re-hashing only.
            log.warning("%s: cannot write the weights cache: %s", self.cache_path, e)

    # --- hashing --------------------------------------------------------------------

    def list_files(self, model: Path) -> list[str]:
        """The names of the files the digest covers, sorted."""
        try:
            names = os.listdir(model)
        except FileNotFoundError:
            raise WeightsError(
                f"model directory {model} does not exist; check engine.model") from None
        except NotADirectoryError:
            raise WeightsError(
                f"engine.model {model} is not a directory; Pitstop needs a local model "
                "directory to know what a snapshot's weights were") from None
        except OSError as e:
            raise WeightsError(f"cannot list the model directory {model}: {e.strerror}") from e
        out = []
        for name in names:
            if not is_model_file(name):
                continue
            try:
                # Followed: a Hugging Face cache's snapshot directory is symlinks to blobs.
                if stat.S_ISREG(os.stat(model / name).st_mode):
                    out.append(name)
            except FileNotFoundError:
                log.warning("%s: dangling symlink in the model directory; ignored", model / name)
        return sorted(out)

    def _hash(self, path: Path) -> tuple[str, int, os.stat_result]:
        """sha256, bytes read, and the stat taken after reading (through the same fd)."""
        h = hashlib.sha256()
        n = 0
        with open(path, "rb", buffering=0) as f:
            before = os.fstat(f.fileno())
            buf = bytearray(_BLOCK)
            view = memoryview(buf)
            while got := f.readinto(buf):
                h.update(view[:got])  # releases the GIL: files hash in parallel
                n += got
            after = os.fstat(f.fileno())
        if stat_key(before) != stat_key(after):
            raise WeightsError(f"{path} changed while it was being hashed; try again")
        return h.hexdigest(), n, after

    def digest(self, model: Path, *, rehash: bool = False) -> WeightsDigest:
        """The digest of `model`; with `rehash`, every file is read again (cache refreshed)."""
        with self._lock:
            return self._digest(Path(model), rehash)

    def _digest(self, model: Path, rehash: bool) -> WeightsDigest:
        t0 = time.monotonic()
        cache = self._load()
        names = self.list_files(model)
        files: dict[str, FileDigest] = {}
        todo: list[tuple[str, str]] = []
        for name in names:
            real = os.path.realpath(model / name)
            try:
                st = os.stat(real)
            except OSError as e:
                raise WeightsError(f"cannot stat {model / name}: {e.strerror}") from e
            hit = cache.get(real)
            if not rehash and hit and hit.get("key") == stat_key(st):
                files[name] = FileDigest(name, st.st_size, hit["sha256"])
            else:
                todo.append((name, real))
        read, changed = 0, False
        if todo:
            with ThreadPoolExecutor(min(self.workers, len(todo))) as pool:
                jobs = [(n, r, pool.submit(self._hash, Path(r))) for n, r in todo]
                for name, real, job in jobs:
                    try:
                        sha, got, st = job.result()
                    except OSError as e:
                        raise WeightsError(f"cannot read {model / name}: {e.strerror}") from e
                    read += got
                    files[name] = FileDigest(name, st.st_size, sha)
                    newest = max(st.st_mtime_ns, st.st_ctime_ns)
                    if self._clock_ns() - newest > self.racy_ns:
                        cache[real] = {"key": stat_key(st), "sha256": sha}
                        changed = True
                    elif cache.pop(real, None) is not None:
                        changed = True
        if changed:
            self._save(self._pruned(cache))
        ordered = tuple(files[n] for n in names)
        return WeightsDigest(model, manifest_digest(ordered), ordered, read, len(todo),
                             time.monotonic() - t0)

    @staticmethod
    def _pruned(cache: dict[str, dict]) -> dict[str, dict]:
        # Entries of deleted files go; other models' entries stay (switching back is free).
        for path in [p for p in cache if not os.path.exists(p)]:
            del cache[path]
        return cache


def cache_path_for(state_dir: Path) -> Path:
    """Where the agent keeps the weights cache: in its private state directory."""
    return Path(state_dir) / CACHE_NAME


def describe_change(old: WeightsDigest | None, new: WeightsDigest) -> list[str]:
    """Which files were added, removed or changed between two digests, for logs."""
    before = {f.name: f for f in old.files} if old else {}
    after = {f.name: f for f in new.files}
    out = [f"added {n}" for n in sorted(after.keys() - before.keys())]
    out += [f"removed {n}" for n in sorted(before.keys() - after.keys())]
    out += [f"changed {n}" for n in sorted(before.keys() & after.keys()) if before[n] != after[n]]
    return out

