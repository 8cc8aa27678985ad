"""What the public ports check, read from its files: at start, and again on every reload."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from agent.config import Config
from agent.errors import ConfigError
from agent.front.auth import ApiKeys, read_keys
from agent.supervisor.status import PortAccess
from agent.tls import ClientAuth, LiveTls, TlsFiles, server_context
from agent.webconfig import WebConfig, read_web_config


@dataclass(frozen=True)
class Access:
    """The front's API keys and TLS context, the metrics endpoint's web configuration and
    TLS context; None where a port serves without TLS (or is off).

    Example::

        access = read_access(config, env_key)   # blocking: reads the files
        access.fits(front_tls, metrics_tls)     # on reload: ConfigError if TLS was added
    """

    front_keys: ApiKeys = ApiKeys()
    front_tls: ssl.SSLContext | None = None
    metrics_web: WebConfig | None = None
    metrics_tls: ssl.SSLContext | None = None

    def fits(self, front: LiveTls | None, metrics: LiveTls | None) -> None:
        """Raise ConfigError unless TLS is on where the running ports serve it, asking for
        client certificates as they do: both are fixed when a port starts listening."""
        if (metrics is None) != (self.metrics_tls is None):
            raise ConfigError("metrics.web_config_file: tls_server_config was added or removed "
                              "since the start; the metrics endpoint serves TLS or not from "
                              "its start: restart the agent to change it")
        for live, ctx in ((front, self.front_tls), (metrics, self.metrics_tls)):
            if live is not None and ctx is not None:
                live.checked(ctx)

    def front_view(self) -> PortAccess:
        ctx = self.front_tls
        return PortAccess(tls=ctx is not None,
                          client_certificates=ctx is not None
                          and ctx.verify_mode == ssl.CERT_REQUIRED,
                          credentials=len(self.front_keys.digests))

    def metrics_view(self) -> PortAccess:
        ctx = self.metrics_tls
        return PortAccess(tls=ctx is not None,
                          client_certificates=ctx is not None
                          and ctx.verify_mode == ssl.CERT_REQUIRED,
                          credentials=len(self.metrics_web.users) if self.metrics_web else 0)


def read_access(config: Config, env_key: str | None) -> Access:
    """Read every file the configuration names for the ports' access (blocking).

    ConfigError names the key and the file when one is missing, unsafe or unreadable."""
    front = config.front
    keys, front_tls = ApiKeys(), None
    if front.enabled:
        keys = read_keys(front.api_key_file, env_key)
        tls = front.tls
        if tls.cert_file is not None and tls.key_file is not None:
            front_tls = server_context(TlsFiles(
                key="front.tls", cert_file=tls.cert_file, key_file=tls.key_file,
                client_ca_file=tls.client_ca_file,
                client_auth=ClientAuth.REQUIRE_AND_VERIFY if tls.client_ca_file
                else ClientAuth.NONE))
    web, metrics_tls = None, None
    if config.metrics.enabled and config.metrics.web_config_file is not None:
        web = read_web_config(config.metrics.web_config_file)
        metrics_tls = server_context(web.tls) if web.tls is not None else None
    return Access(front_keys=keys, front_tls=front_tls, metrics_web=web,
                  metrics_tls=metrics_tls)
