"""The Prometheus exporter toolkit's web configuration file: TLS and basic auth for /metrics."""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.errors import ConfigError
from agent.tls import ClientAuth, TlsFiles

# The toolkit's settings this endpoint does not implement: refused by name rather than
# ignored, since each of them would narrow who may scrape.
_UNSUPPORTED_TLS = ("cert", "key", "client_ca", "client_allowed_sans", "cipher_suites",
                    "curve_preferences", "prefer_server_cipher_suites")
_UNSUPPORTED_TOP = ("http_server_config", "rate_limit")
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
             "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# The toolkit's names for a client certificate that is asked for but never verified.
_UNVERIFIED = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
# What bcrypt writes: $2a$, $2b$ or $2y$, a two-digit cost, 22 characters of salt, 31 of hash.
_BCRYPT = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")

Version = Literal["TLS10", "TLS11", "TLS12", "TLS13"]


class _TlsServer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    client_auth_type: str = ""
    min_version: Version = "TLS12"
    max_version: Version = "TLS13"


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tls_server_config: _TlsServer | None = None
    basic_auth_users: dict[str, str] = {}


@dataclass(frozen=True)
class WebConfig:
    """What the metrics endpoint serves with: TLS files, and users with bcrypt hashes.

    Example::

        web = read_web_config(Path("/etc/pitstop/web-config.yml"))
        web.tls            # TlsFiles, or None for plain HTTP
        web.users["prom"]  # b"$2b$12$..."
    """

    path: Path
    tls: TlsFiles | None = None
    users: dict[str, bytes] = field(default_factory=dict)


def read_web_config(path: Path) -> WebConfig:
    """Read and check the file (blocking). Paths in it are relative to its directory, as
    the toolkit reads them. ConfigError names the file and the setting that is wrong."""
    where = f"metrics.web_config_file: {path}"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    _refuse_unsupported(where, data)
    try:
        parsed = _File.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: {key}: {err['msg']}") from None
    return WebConfig(path=path, tls=_tls(where, path.parent, parsed.tls_server_config),
                     users=_users(where, parsed.basic_auth_users))


def _refuse_unsupported(where: str, data: dict[str, Any]) -> None:
    tls = data.get("tls_server_config")
    found = [k for k in _UNSUPPORTED_TOP if k in data]
    if isinstance(tls, dict):
        found += [f"tls_server_config.{k}" for k in _UNSUPPORTED_TLS if k in tls]
    if found:
        raise ConfigError(f"{where}: {', '.join(found)}: an exporter toolkit setting that "
                          "Pitstop's metrics endpoint does not implement; remove it "
                          "(docs/operations.md lists what is read)")


def _client_auth(where: str, tls: _TlsServer) -> ClientAuth:
    name = tls.client_auth_type or ClientAuth.NONE.value
    if name in _UNVERIFIED:
        raise ConfigError(
            f"{where}: tls_server_config.client_auth_type: {name} accepts a client certificate "
            "that nobody verified; use RequireAndVerifyClientCert (or VerifyClientCertIfGiven) "
            "with client_ca_file")
    try:
        auth = ClientAuth(name)
    except ValueError:
        raise ConfigError(f"{where}: tls_server_config.client_auth_type: {name!r} is none of "
                          f"{', '.join(a.value for a in ClientAuth)}") from None
    if auth is ClientAuth.NONE and tls.client_ca_file:
        raise ConfigError(f"{where}: tls_server_config.client_ca_file is set but "
                          "client_auth_type is NoClientCert; set client_auth_type to "
                          "RequireAndVerifyClientCert to ask for client certificates")
    if auth is not ClientAuth.NONE and not tls.client_ca_file:
        raise ConfigError(f"{where}: tls_server_config.client_auth_type {name} needs "
                          "client_ca_file: the CA that signs the client certificates")
    return auth


def _tls(where: str, base: Path, tls: _TlsServer | None) -> TlsFiles | None:
    if tls is None:
        return None
    low, high = _VERSIONS[tls.min_version], _VERSIONS[tls.max_version]
    if low > high:
        raise ConfigError(f"{where}: tls_server_config.min_version {tls.min_version} is above "
                          f"max_version {tls.max_version}")
    return TlsFiles(
        key=f"{where}: tls_server_config", cert_file=base / tls.cert_file,
        key_file=base / tls.key_file,
        client_ca_file=base / tls.client_ca_file if tls.client_ca_file else None,
        client_auth=_client_auth(where, tls), min_version=low, max_version=high)


def _users(where: str, users: dict[str, str]) -> dict[str, bytes]:
    for user, hashed in users.items():
        if not user or ":" in user:
            raise ConfigError(f"{where}: basic_auth_users: {user!r} cannot be sent in basic "
                              "auth (empty, or holds ':')")
        if not _BCRYPT.match(hashed):
            raise ConfigError(f"{where}: basic_auth_users.{user}: not a bcrypt hash; make one "
                              "with `htpasswd -nBC 10 \"\" | tr -d ':'` or Python's "
                              "bcrypt.hashpw")
    return {u: h.encode() for u, h in users.items()}
