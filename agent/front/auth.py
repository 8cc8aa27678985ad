"""API keys at the front: read from a private file or PITSTOP_API_KEY, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
import os
import pwd
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from agent.errors import ConfigError
from agent.front.sse import error_body

# Like vLLM's VLLM_API_KEY: a key given in the agent's environment (its unit's drop-in).
ENV = "PITSTOP_API_KEY"
# vLLM's own variable: in the agent's environment the engine would inherit it.
VLLM_ENV = "VLLM_API_KEY"
_MAX_FILE_BYTES = 1 << 20
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))  # printable ASCII, no space


@dataclass(frozen=True)
class ApiKeys:
    """The keys in effect, kept only as SHA-256 digests: nothing here can print a key.

    Example::

        keys = read_keys(Path("/etc/pitstop/api-keys"), env_key=None)
        keys.allows("Bearer sk-...")   # True for any key of the file
    """

    digests: tuple[bytes, ...] = ()
    # Where they came from, for the log: file names and the variable's name, never a key.
    source: str = ""

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.digests)} from {self.source or 'nowhere'})"

    def allows(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries one of the keys, as vLLM checks it: the
        Bearer scheme in any case, then the token's digest against every key's. Digests make
        the compared lengths equal, and every key is compared: the time taken says nothing
        about which key, or how much of one, matched."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # surrogatepass: a header with any code point hashes instead of raising.
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = False
        for d in self.digests:
            found |= hmac.compare_digest(digest, d)
        return found


def take_env_key(environ: MutableMapping[str, str]) -> str | None:
    """PITSTOP_API_KEY, removed from `environ` so that no child (the engine, CRIU) inherits
    it. VLLM_API_KEY there is refused: the engine would inherit it and lock the agent out."""
    if VLLM_ENV in environ:
        raise ConfigError(f"the agent's environment sets {VLLM_ENV}: the engine would inherit "
                          "it and refuse the agent's own health checks, canary and resumed "
                          f"streams; rename it {ENV} (the front checks it) or remove it")
    value = environ.pop(ENV, None)
    return value.strip() if value and value.strip() else None


def read_keys(path: Path | None, env_key: str | None) -> ApiKeys:
    """The keys of `path` (front.api_key_file) and `env_key`; blocking (it reads the file).

    ConfigError when the file is missing, readable by others, not the agent's user's, holds
    no key or a line that is no key: the error names the file and the line, never a key."""
    keys: list[str] = []
    sources: list[str] = []
    if env_key:
        _check_key(env_key, ENV)
        keys.append(env_key)
        sources.append(ENV)
    if path is not None:
        keys.extend(_read_file(path))
        sources.append(str(path))
    digests = tuple(dict.fromkeys(hashlib.sha256(k.encode()).digest() for k in keys))
    return ApiKeys(digests, " and ".join(sources))


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _read_file(path: Path) -> list[str]:
    where = f"front.api_key_file: {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror}; write one key a line, "
                          "mode 0600, owned by the agent's user") from None
    with os.fdopen(fd, "rb") as f:
        # fstat of the file opened: the checks are about the bytes read, not a name.
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{where}: owned by {_owner(st.st_uid)}, not by the agent's "
                              f"user {_owner(os.geteuid())}: chown it to that user")
        mode = stat.S_IMODE(st.st_mode)
        if mode not in (0o600, 0o400):
            raise ConfigError(f"{where}: mode {mode:04o} lets others read or run the keys; "
                              f"chmod 600 {path}")
        data = f.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {_MAX_FILE_BYTES} bytes: not a key file")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: holds bytes outside ASCII; a key is printable ASCII "
                          "(as sent in `Authorization: Bearer KEY`)") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if key and not key.startswith("#"):
            _check_key(key, f"{where}: line {n}")
            keys.append(key)
    if not keys:
        raise ConfigError(f"{where}: holds no key; write one key a line (or remove "
                          "front.api_key_file to serve without keys)")
    return keys


def _check_key(key: str, where: str) -> None:
    if not set(key) <= _KEY_CHARS:
        raise ConfigError(f"{where}: not a key: a key is one word of printable ASCII, with no "
                          "space or tab (as sent in `Authorization: Bearer KEY`)")


def unauthorized() -> web.Response:
    """The OpenAI-shaped 401 (`AuthenticationError` in the openai client)."""
    return web.json_response(
        error_body("a valid API key is required: send it as `Authorization: Bearer KEY`",
                   401, "AuthenticationError"),
        status=401, headers={"WWW-Authenticate": "Bearer"})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def key_check(keys: Callable[[], ApiKeys], open_paths: frozenset[str],
              refused: Callable[[web.Request], None]) -> Middleware:
    """An aiohttp middleware: with keys in effect, every path but `open_paths` needs one.

    It runs before the route's handler, so a refused request is never held, read or
    forwarded; `refused` counts it.
    """

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        current = keys()
        if current.required and request.path not in open_paths and \
                not current.allows(request.headers.get("Authorization")):
            refused(request)
            return unauthorized()
        return await handler(request)

    return check
