import dataclasses
from typing import Annotated

import msgspec
import pytest

from libs.bus import ServiceSettings, SettingsError, env_prefix, load_settings


class BrokerSettings(ServiceSettings, frozen=True, kw_only=True):
    lease_ms: Annotated[int, msgspec.Meta(gt=0)] = 30_000
    strict: bool = False
    buckets: list[str] = []

    def __post_init__(self):
        if self.strict and not self.buckets:
            raise ValueError("strict needs at least one bucket")


def test_prefix_normalization():
    assert env_prefix("kv-broker") == env_prefix("MOEMESH_KV_BROKER") == "MOEMESH_KV_BROKER_"


def test_defaults_env_and_flags_with_flags_winning():
    env = {"MOEMESH_BROKER_LEASE_MS": "500", "MOEMESH_BROKER_HTTP_PORT": "9000", "MOEMESH_OTHER_X": "ignored"}
    s = load_settings(
        BrokerSettings, "broker", ["--lease-ms", "700", "--strict", "--buckets", "a,b"], env=env
    )
    assert (s.lease_ms, s.http_port, s.strict, s.buckets) == (700, 9000, True, ["a", "b"])
    assert s.nats_url == "nats://127.0.0.1:4222"
    with pytest.raises(AttributeError):
        s.lease_ms = 1  # frozen


def test_shared_nats_url_and_prefixed_override():
    env = {"MOEMESH_NATS_URL": "nats://shared:4222"}
    assert load_settings(BrokerSettings, "broker", env=env).nats_url == "nats://shared:4222"
    env["MOEMESH_BROKER_NATS_URL"] = "nats://mine:4222"
    assert load_settings(BrokerSettings, "broker", env=env).nats_url == "nats://mine:4222"


def test_json_list_and_bool_env():
    s = load_settings(
        BrokerSettings, "broker", env={"MOEMESH_BROKER_BUCKETS": '["x"]', "MOEMESH_BROKER_STRICT": "true"}
    )
    assert s.buckets == ["x"] and s.strict is True


@pytest.mark.parametrize(
    ("env", "argv", "match"),
    [
        ({"MOEMESH_BROKER_LEASE_MSS": "1"}, [], "unknown setting MOEMESH_BROKER_LEASE_MSS"),
        ({}, ["--leas-ms", "1"], "unknown command-line arguments"),
        ({"MOEMESH_BROKER_LEASE_MS": "soon"}, [], "MOEMESH_BROKER_LEASE_MS='soon'"),
        ({}, ["--lease-ms", "0"], "lease_ms"),
        ({"MOEMESH_BROKER_HTTP_PORT": "70000"}, [], "http_port"),
        ({}, ["--strict"], "strict needs at least one bucket"),
    ],
)
def test_bad_settings_name_the_problem(env, argv, match):
    with pytest.raises(SettingsError, match=match):
        load_settings(BrokerSettings, "broker", argv, env=env)


def test_dataclass_settings_and_frozen_required():
    @dataclasses.dataclass(frozen=True)
    class D:
        n: int = 1

    assert load_settings(D, "d", env={"MOEMESH_D_N": "3"}) == D(n=3)

    class Loose(msgspec.Struct):
        n: int = 1

    with pytest.raises(TypeError, match="frozen"):
        load_settings(Loose, "x", env={})
