"""TLS server contexts read from PEM files, renewed on reload without dropping connections."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from agent.errors import ConfigError


class ClientAuth(StrEnum):
    """Whether a handshake asks for a client certificate: the exporter toolkit's names.

    The toolkit's RequestClientCert and RequireAnyClientCert accept a certificate nobody
    verified; Python's TLS cannot, and a certificate that is not checked proves nothing.
    """

    NONE = "NoClientCert"
    VERIFY_IF_GIVEN = "VerifyClientCertIfGiven"
    REQUIRE_AND_VERIFY = "RequireAndVerifyClientCert"


_VERIFY = {ClientAuth.NONE: ssl.CERT_NONE, ClientAuth.VERIFY_IF_GIVEN: ssl.CERT_OPTIONAL,
           ClientAuth.REQUIRE_AND_VERIFY: ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class TlsFiles:
    """What one TLS server reads; `key` names the setting in errors (front.tls, ...)."""

    key: str
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    client_auth: ClientAuth = ClientAuth.NONE
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED


class _Encrypted(Exception):
    """The private key asks for a passphrase."""


def _no_passphrase() -> bytes:
    # Without this, OpenSSL would prompt on the terminal for an encrypted key's passphrase.
    raise _Encrypted


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context with the files' certificate chain, key and client CAs (blocking: it
    reads them). ConfigError names the file and what is wrong with it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = files.min_version
    ctx.maximum_version = files.max_version
    for path in (files.cert_file, files.key_file, files.client_ca_file):
        if path is not None:
            _readable(files.key, path)
    pair = f"{files.key}: {files.cert_file} and {files.key_file}"
    try:
        ctx.load_cert_chain(files.cert_file, files.key_file, password=_no_passphrase)
    except _Encrypted:
        raise ConfigError(f"{files.key}: {files.key_file} is an encrypted private key; the "
                          "agent starts unattended, so give it the key without a passphrase "
                          "(mode 0600)") from None
    except ssl.SSLError as e:
        raise ConfigError(f"{pair} are not a PEM certificate chain and its private key "
                          f"({e.reason or e})") from None
    ctx.verify_mode = _VERIFY[files.client_auth]
    if files.client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=files.client_ca_file)
        except ssl.SSLError as e:
            raise ConfigError(f"{files.key}: {files.client_ca_file} holds no PEM CA "
                              f"certificate ({e.reason or e})") from None
    return ctx


def _readable(key: str, path: Path) -> None:
    # OpenSSL's own error does not say which of the files it could not open.
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None


class LiveTls:
    """The context a server listens with, whose handshakes use the newest context read.

    A listening socket keeps the context it was made with; OpenSSL calls its server-name
    callback at every handshake (with or without SNI), and that hands the connection the
    newest context. Open connections keep the certificate they shook hands with.

    Example::

        tls = LiveTls(server_context(files))
        site = web.TCPSite(runner, host, port, ssl_context=tls.listening)
        tls.use(tls.checked(server_context(files)))   # on reload: new handshakes only
    """

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.listening = ctx
        self._current = ctx
        ctx.sni_callback = self._pick

    def _pick(self, conn: ssl.SSLObject, server_name: str | None,
              ctx: ssl.SSLContext) -> None:
        if self._current is not ctx:
            conn.context = self._current

    def checked(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        """`ctx`, if it asks for client certificates as the listening one does: switching
        contexts in a handshake changes the certificates, not whether one is asked for."""
        if ctx.verify_mode != self.listening.verify_mode:
            raise ConfigError("TLS client certificates: whether they are asked for is set at "
                              "start; restart the agent to change it")
        return ctx

    def use(self, ctx: ssl.SSLContext) -> None:
        self._current = ctx
