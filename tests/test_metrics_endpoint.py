"""The metrics endpoint with the exporter toolkit's web configuration: the file is read as
the toolkit reads it or refused by name, and the endpoint serves TLS and basic auth."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import aiohttp
import bcrypt
import pytest
import yaml

from agent.errors import ConfigError
from agent.metrics import Metrics, NodeInfo, StatusView, new_registry
from agent.metrics_endpoint import MetricsEndpoint
from agent.tls import ClientAuth, LiveTls, server_context
from agent.webconfig import read_web_config
from tests.tlskit import TestCA

PASSWORD = "scrape-0123456789"
# Cost 4, bcrypt's lowest: the tests check the format, not the cost.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


def web_file(tmp: Path, doc: dict) -> Path:
    p = tmp / "web-config.yml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_a_toolkit_web_config_is_read_with_paths_relative_to_its_directory(tmp_path):
    web = read_web_config(web_file(tmp_path, {
        "tls_server_config": {"cert_file": "tls/m.crt", "key_file": "/abs/m.key",
                              "client_ca_file": "ca.crt",
                              "client_auth_type": "RequireAndVerifyClientCert",
                              "min_version": "TLS13"},
        "basic_auth_users": {"prometheus": HASH}}))
    assert web.tls is not None
    assert web.tls.cert_file == tmp_path / "tls" / "m.crt"
    assert web.tls.key_file == Path("/abs/m.key")
    assert web.tls.client_ca_file == tmp_path / "ca.crt"
    assert web.tls.client_auth is ClientAuth.REQUIRE_AND_VERIFY
    assert web.tls.min_version is ssl.TLSVersion.TLSv1_3
    assert web.users == {"prometheus": HASH.encode()}
    assert read_web_config(web_file(tmp_path, {})).tls is None


@pytest.mark.parametrize("doc, says", [
    ({"http_server_config": {"http2": False}}, "http_server_config: an exporter toolkit "
                                               "setting that Pitstop's metrics endpoint does "
                                               "not implement"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": []}},
     "tls_server_config.cipher_suites: an exporter toolkit setting"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b",
                            "client_auth_type": "RequireAnyClientCert", "client_ca_file": "c"}},
     "RequireAnyClientCert accepts a client certificate that nobody verified"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_ca_file": "c"}},
     "client_ca_file is set but client_auth_type is NoClientCert"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b",
                            "client_auth_type": "VerifyClientCertIfGiven"}},
     "needs client_ca_file"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "Maybe"}},
     "'Maybe' is none of NoClientCert"),
    ({"tls_server_config": {"cert_file": "a"}}, "tls_server_config.key_file: Field required"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "TLS13",
                            "max_version": "TLS12"}}, "min_version TLS13 is above max_version"),
    ({"basic_auth_users": {"prometheus": "plain-text-password"}},
     "basic_auth_users.prometheus: not a bcrypt hash"),
    ({"basic_auth_users": {"a:b": HASH}}, "cannot be sent in basic auth"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b"}, "typo": 1},
     "typo: Extra inputs are not permitted"),
])
def test_a_web_config_the_endpoint_cannot_honour_is_refused_by_name(tmp_path, doc, says):
    with pytest.raises(ConfigError) as e:
        read_web_config(web_file(tmp_path, doc))
    assert str(e.value).startswith(f"metrics.web_config_file: {tmp_path / 'web-config.yml'}: ")
    assert says in str(e.value)
    assert "plain-text-password" not in str(e.value)


def test_a_missing_web_config_says_so(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it: No such file"):
        read_web_config(tmp_path / "absent.yml")


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def test_the_endpoint_serves_tls_and_basic_auth_and_a_reload_changes_both(tmp_path):
    ca = TestCA(tmp_path / "ca")
    first = ca.issue("metrics", server=True)
    web = read_web_config(web_file(tmp_path, {
        "tls_server_config": {"cert_file": str(first.cert), "key_file": str(first.key)},
        "basic_auth_users": {"prometheus": HASH}}))
    assert web.tls is not None
    registry = new_registry()
    Metrics(registry, lambda: StatusView("ready", True, None, (), NodeInfo()))
    trusting = ssl.create_default_context(cafile=ca.cert)

    async def main() -> None:
        ep = MetricsEndpoint(registry, "127.0.0.1", 0, web, LiveTls(server_context(web.tls)))
        await ep.start()
        url = f"https://127.0.0.1:{ep.port}/metrics"
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=trusting)) as s:
                async def status(headers: dict[str, str]) -> int:
                    async with s.get(url, headers=headers) as r:
                        await r.read()
                        return r.status

                async with s.get(url, headers=_basic("prometheus", PASSWORD)) as r:
                    assert r.status == 200 and "pitstop_engine_up 1.0" in await r.text()
                # Twice: the second comes from the cache of verified credentials.
                assert await status(_basic("prometheus", PASSWORD)) == 200
                for refused in ({}, _basic("prometheus", "wrong"), _basic("nobody", PASSWORD),
                                {"Authorization": "Bearer " + PASSWORD},
                                {"Authorization": "Basic !!!"}, _basic("prometheus", "x" * 80)):
                    assert await status(refused) == 401, refused
                # A reload: another user; the old one's cached success does not survive it.
                other = bcrypt.hashpw(b"second", bcrypt.gensalt(4)).decode()
                second = ca.issue("metrics-2", server=True)
                new = read_web_config(web_file(tmp_path, {
                    "tls_server_config": {"cert_file": str(second.cert),
                                          "key_file": str(second.key)},
                    "basic_auth_users": {"grafana-agent": other}}))
                assert new.tls is not None
                ep.use(new, ep.tls.checked(server_context(new.tls)) if ep.tls else None)
                assert await status(_basic("prometheus", PASSWORD)) == 401
                assert await status(_basic("grafana-agent", "second")) == 200
            # Plain HTTP on the TLS port is no way around it.
            async with aiohttp.ClientSession() as s:
                with pytest.raises(aiohttp.ClientError):
                    await s.get(f"http://127.0.0.1:{ep.port}/metrics")
        finally:
            await ep.stop()

    asyncio.run(main())


def test_without_a_web_config_the_endpoint_serves_plain_http_with_openmetrics(tmp_path):
    registry = new_registry()
    Metrics(registry, lambda: StatusView("ready", True, None, (), NodeInfo()))

    async def main() -> None:
        ep = MetricsEndpoint(registry, "127.0.0.1", 0)
        await ep.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{ep.port}/metrics", headers={
                        "Accept": "application/openmetrics-text; version=1.0.0"}) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("application/openmetrics-text")
                    assert (await r.text()).endswith("# EOF\n")
                async with s.get(f"http://127.0.0.1:{ep.port}/metrics",
                                 params={"name[]": "pitstop_recoveries_total"}) as r:
                    body = await r.text()
                    assert "# TYPE pitstop_recoveries_total counter" in body
                    assert "pitstop_engine_up" not in body
        finally:
            await ep.stop()

    asyncio.run(main())
