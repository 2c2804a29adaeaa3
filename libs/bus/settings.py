"""Service settings: one frozen, validated object per service, from env vars and CLI flags.

`load_settings(cls, "broker", argv)` reads `MOEMESH_BROKER_<FIELD>` env vars, then `--<field>` flags
(flags win), and validates through msgspec (types and `Meta` constraints; `__post_init__` for cross-field
rules). An env var under the service's prefix that names no field is an error, so a typo in a compose
file or a Kubernetes manifest fails at start instead of being silently ignored. The fields in
SHARED_FIELDS may also come from the unprefixed `MOEMESH_<FIELD>` (one NATS URL for every container).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from libs.bus.security import MASK, is_secret, redacted_repr

S = TypeVar("S")

# also read from the unprefixed MOEMESH_<FIELD>: one NATS address and one set of credentials for all
SHARED_FIELDS = (
    "nats_url", "log_level", "nats_user", "nats_password", "nats_token", "nats_tls_ca", "nats_tls_cert",
    "nats_tls_key",
)  # fmt: skip


class SettingsError(ValueError):
    """Unknown key, unknown flag or invalid value in a service's settings."""


class ServiceSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Fields every service has; a service's settings subclass this and add their own."""

    nats_url: str = "nats://127.0.0.1:4222"
    instance_id: str = ""  # empty: "<service>-<random>"
    http_host: str = "0.0.0.0"
    http_port: Annotated[int, msgspec.Meta(ge=-1, le=65535)] = 0  # 0: off, -1: any free port
    # where to write the bound ports as JSON once serving (libs.bus.ports); empty: nowhere
    ports_file: str = ""
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    log_level: str = "INFO"
    # the event loop (libs/bus/loop.py): "auto" takes uvloop when installed, else asyncio's own. With every
    # service on it the mesh's TTFT fell ~0.3-0.45 ms in paired A/B runs (bench.mesh_ab) and the gateway
    # streamed no fewer SSE tokens per core (README, Benchmarks)
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # a service run as its own process freezes its start-up heap once set up (gc.freeze, as vLLM does), so
    # collections of the oldest generation skip the model and imports (libs/telemetry/gc_pauses.py)
    gc_freeze: bool = True
    # NATS authentication and TLS (libs.bus.security): user + password or a token; CA to verify the
    # server, client certificate + key for mutual TLS. Secrets print as *** (see __repr__).
    nats_user: str = ""
    nats_password: str = ""
    nats_token: str = ""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""

    def __repr__(self) -> str:
        return redacted_repr(self)


def env_prefix(service: str) -> str:
    """ "broker" / "MOEMESH_BROKER" / "MOEMESH_BROKER_" -> "MOEMESH_BROKER_"."""
    p = service.upper().replace("-", "_")
    if not p.startswith("MOEMESH_"):
        p = "MOEMESH_" + p
    return p if p.endswith("_") else p + "_"


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        if not cls.__struct_config__.frozen:
            raise TypeError(f"settings class {cls.__name__} must be frozen (msgspec.Struct frozen=True)")
        return {f.name: hints[f.name] for f in msgspec.structs.fields(cls)}
    if dataclasses.is_dataclass(cls):
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"settings class {cls.__name__} must be frozen (@dataclass(frozen=True))")
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    raise TypeError(f"settings class must be a msgspec.Struct or a dataclass, got {cls!r}")


def _base_type(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _parse(tp: Any, raw: str) -> Any:
    """Strings for scalars (msgspec converts them, non-strictly); JSON or comma lists for containers."""
    origin = typing.get_origin(_base_type(tp)) or _base_type(tp)
    if origin in (list, tuple, set, frozenset):
        raw = raw.strip()
        if raw.startswith("["):
            return json.loads(raw)
        return [x.strip() for x in raw.split(",") if x.strip()]
    if origin is dict:
        return json.loads(raw)
    return raw


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def load_settings(
    cls: type[S], prefix: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> S:
    """Build `cls` (a frozen msgspec Struct or dataclass) from env vars and CLI flags.

    `prefix` is the service name or its env prefix ("broker" == "MOEMESH_BROKER_"). `argv` defaults to
    no flags (not sys.argv, so tests and embedding never pick up a foreign command line); `env` to
    os.environ. Raises SettingsError naming the offending key, flag or value.
    """
    fields = _fields(cls)
    prefix = env_prefix(prefix)
    env = os.environ if env is None else env
    raw: dict[str, tuple[str, str]] = {}  # field -> (source, value)
    for name in SHARED_FIELDS:
        if name in fields and "MOEMESH_" + name.upper() in env:
            raw[name] = ("MOEMESH_" + name.upper(), env["MOEMESH_" + name.upper()])
    for key, value in env.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :].lower()
        if name not in fields:
            known = ", ".join(prefix + f.upper() for f in fields)
            raise SettingsError(f"unknown setting {key}; known: {known}")
        raw[name] = (key, value)
    raw.update(_parse_flags(cls, fields, prefix, list(argv or [])))
    values: dict[str, Any] = {}
    for name, (source, value) in raw.items():
        try:
            values[name] = _parse(fields[name], value)
        except ValueError as e:
            raise SettingsError(f"{source}={_shown(name, value)}: {e}") from None
    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as e:
        raise SettingsError(f"invalid {cls.__name__}: {e}{_sources(str(e), raw)}") from None
    except (TypeError, ValueError) as e:  # __post_init__ checks
        raise SettingsError(f"invalid {cls.__name__}: {e}") from None


def _parse_flags(
    cls: type, fields: dict[str, Any], prefix: str, argv: list[str]
) -> dict[str, tuple[str, str]]:
    parser = argparse.ArgumentParser(description=f"{cls.__name__} (env prefix {prefix})", allow_abbrev=False)
    for name, tp in fields.items():
        if _base_type(tp) is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(_flag(name), dest=name, default=None, metavar=prefix + name.upper())
    ns, extra = parser.parse_known_args(argv)
    if extra:
        raise SettingsError(f"unknown command-line arguments for {cls.__name__}: {' '.join(extra)}")
    out: dict[str, tuple[str, str]] = {}
    for name, value in vars(ns).items():
        if value is not None:
            out[name] = (_flag(name), str(value).lower() if isinstance(value, bool) else value)
    return out


def _sources(err: str, raw: dict[str, tuple[str, str]]) -> str:
    for name, (source, value) in raw.items():
        if f"$.{name}`" in err:
            return f" (from {source}={_shown(name, value)})"
    return ""


def _shown(name: str, value: str) -> str:
    return MASK if is_secret(name) else repr(value)
