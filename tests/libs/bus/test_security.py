"""NATS credentials and TLS reach the connection of every service (real nats-server requiring them),
and secrets never show up in a settings repr, an error or a log line."""

from __future__ import annotations

import logging
import ssl
import subprocess
from pathlib import Path

import pytest

from libs.bus import Bus, BusError, Service, ServiceSettings, SettingsError, load_settings
from libs.bus.security import nats_connect_options, redact_url, tls_context
from libs.launch.natsauth import NatsAuth
from libs.natsd import start_nats_server
from services.gateway.settings import GatewaySettings
from tests.service_helpers import start_service, stop_service

PASSWORD, TOKEN, API_KEY = "hunter2-pw", "s3cret-token", "sk-live-key"


def test_redact_url() -> None:
    assert redact_url("nats://u:hunter2@h:4222") == "nats://u:***@h:4222"
    assert redact_url("nats://tok@h:4222") == "nats://***@h:4222"
    assert redact_url("nats://h:4222") == "nats://h:4222"
    assert redact_url("nats://a:x@h1:1,nats://b:y@h2:2") == "nats://a:***@h1:1,nats://b:***@h2:2"


def test_settings_never_print_secrets() -> None:
    env = {
        "MOEMESH_NATS_URL": f"nats://admin:{PASSWORD}@127.0.0.1:4222",
        "MOEMESH_NATS_USER": "admin", "MOEMESH_NATS_PASSWORD": PASSWORD,
        "MOEMESH_GATEWAY_API_KEY": API_KEY, "MOEMESH_GATEWAY_MODEL_DIR": "/m",
    }  # fmt: skip
    s = load_settings(GatewaySettings, "gateway", env=env)
    assert s.nats_password == PASSWORD and s.api_key == API_KEY  # read from the shared env
    for text in (repr(s), str(s), f"{s}"):
        assert PASSWORD not in text and API_KEY not in text and "nats_password=***" in text
    t = ServiceSettings(nats_token=TOKEN)
    assert TOKEN not in repr(t) and "nats_token=***" in repr(t)
    with pytest.raises(SettingsError) as e:  # a bad value is named, a secret's value is not shown
        load_settings(ServiceSettings, "x", env={"MOEMESH_NATS_TOKEN": TOKEN, "MOEMESH_X_HTTP_PORT": "many"})
    assert TOKEN not in str(e.value)
    assert PASSWORD not in repr(NatsAuth(user="u", password=PASSWORD))


def test_connect_options_and_their_checks() -> None:
    assert nats_connect_options(ServiceSettings()) == {}
    assert nats_connect_options(ServiceSettings(nats_user="u", nats_password="p")) == {
        "user": "u",
        "password": "p",
    }
    assert nats_connect_options(ServiceSettings(nats_token="t")) == {"token": "t"}
    with pytest.raises(ValueError, match="token or"):
        nats_connect_options(ServiceSettings(nats_token="t", nats_user="u"))
    with pytest.raises(ValueError, match="certificate and its key"):
        tls_context(cert="c.pem")


async def _serve_once(settings: ServiceSettings) -> None:
    svc = Service(settings)
    task = await start_service(svc, 15)  # a connection error raises here
    await stop_service(svc, task, 10)


@pytest.mark.parametrize(
    "auth", [NatsAuth(user="svc", password=PASSWORD), NatsAuth(token=TOKEN)], ids=["user", "token"]
)
async def test_service_connects_with_credentials_and_not_without(
    auth: NatsAuth, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_nats_server(jetstream=False, extra_args=auth.server_args(tmp_path))
    try:
        assert PASSWORD not in " ".join(map(str, server.proc.args)) and TOKEN not in " ".join(
            map(str, server.proc.args)
        )
        fields = {"nats_user": auth.user, "nats_password": auth.password, "nats_token": auth.token}
        caplog.set_level(logging.DEBUG)
        await _serve_once(
            ServiceSettings(nats_url=server.url, connect_timeout_s=5, drain_timeout_s=1, **fields)
        )
        assert "service" in caplog.text and PASSWORD not in caplog.text and TOKEN not in caplog.text
        with pytest.raises(BusError) as e:  # no credentials: refused by the server
            await Bus.connect(server.url, "anon", connect_deadline=1.0)
        assert PASSWORD not in str(e.value)
        url_with_secret = server.url.replace("nats://", f"nats://svc:{PASSWORD}-wrong@")
        with pytest.raises(BusError) as e:
            await Bus.connect(url_with_secret, "wrong", connect_deadline=1.0)
        assert PASSWORD not in str(e.value) and "***" in str(e.value)
        assert PASSWORD not in caplog.text and TOKEN not in caplog.text
    finally:
        server.stop()


def _self_signed(tmp: Path) -> tuple[str, str]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


async def test_tls_with_a_ca_the_service_trusts(tmp_path: Path) -> None:
    try:
        cert, key = _self_signed(tmp_path)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"openssl cannot make a test certificate: {e}")
    auth = NatsAuth(user="svc", password=PASSWORD, tls_cert=cert, tls_key=key, tls_ca=cert)
    server = start_nats_server(jetstream=False, extra_args=auth.server_args(tmp_path))
    try:
        settings = ServiceSettings(
            nats_url=server.url, nats_user="svc", nats_password=PASSWORD, nats_tls_ca=cert,
            connect_timeout_s=5, drain_timeout_s=1,
        )  # fmt: skip
        await _serve_once(settings)
        bus = await Bus.connect(server.url, "tls-client", connect_deadline=5, **auth.client_options())
        assert bus.is_connected
        await bus.close()
        with pytest.raises(BusError):  # a client that does not trust the server's certificate
            await Bus.connect(server.url, "untrusting", connect_deadline=1.0, user="svc", password=PASSWORD,
                              tls=ssl.create_default_context())  # fmt: skip  (the system store lacks our CA)
    finally:
        server.stop()
