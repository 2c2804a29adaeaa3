"""Service settings: one frozen, validated object per service, layered highest first: `--<field>` flags (and
FLAG_ALIASES), `MOEMESH_<SERVICE>_<FIELD>` env vars, the YAML config file (`--config FILE` or MOEMESH_CONFIG),
the default. A key, env var or flag that names nothing is an error, so typos fail at start."""

# msgspec validates the result (types, Meta constraints, __post_init__). SHARED_FIELDS may also come from the
# unprefixed MOEMESH_<FIELD>. In the config file, top-level keys are `moemesh up`'s options (LAUNCHER_KEYS)
# and the engine settings both worker kinds read (ENGINE_KEYS); a section per service (SECTIONS) beats them.

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from libs.bus.security import MASK, is_secret, redact_url, redacted_repr

S = TypeVar("S")

# also read from the unprefixed MOEMESH_<FIELD>: one NATS address and one set of credentials for all
SHARED_FIELDS = (
    "nats_url", "log_level", "nats_user", "nats_password", "nats_token", "nats_tls_ca", "nats_tls_cert",
    "nats_tls_key", "malloc_trim_s", "malloc_arena_max",
)  # fmt: skip

CONFIG_ENV = "MOEMESH_CONFIG"
# the config file's per-service sections, named as the services are
SECTIONS = ("gateway", "scheduler", "kv-broker", "prefill-worker", "decode-worker")
# worker settings a config file may set at its top level, for both worker kinds (also `moemesh up` flags)
ENGINE_KEYS = (
    "device", "dtype", "quantization", "page_size", "num_pages", "max_num_seqs", "max_prefill_tokens",
    "enable_prefix_cache", "kv_cache_dtype", "attention_backend", "ep_size", "dp_size", "ep_backend",
    "two_batch_overlap", "warmup", "transfer_protocol", "host_kv_pages", "host_kv_cache_gb",
)  # fmt: skip
# `moemesh up`'s own options a config file may set at its top level, by dest (libs/cli/up.py; a test keeps
# them equal): `--scheduler` is scheduler_mode, the `scheduler` section being the scheduler service's
LAUNCHER_KEYS = (
    "model", "host", "port", "nats_port", "prefill_workers", "decode_workers", "schedulers", "scheduler_mode",
    "gateways", "nats_user", "nats_password", "nats_token", "nats_tls_cert", "nats_tls_key", "nats_tls_ca",
    "served_model_name", "reasoning_parser", "prefill_gpus", "decode_gpus", "log_dir", "restart_backoff",
    "restart_max_backoff", "restart_limit",
    "restart_window", "ready_timeout", "kv_store",
)  # fmt: skip


class SettingsError(ValueError):
    """Unknown key, unknown flag or invalid value in a service's settings."""


def _d(description: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class ServiceSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Fields every service has; a service's settings subclass this and add their own."""

    # field -> extra flag names (vLLM's where it has one), e.g. {"page_size": ("block_size",)}
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}

    nats_url: Annotated[str, _d("NATS server URL (comma-separated for a cluster)")] = "nats://127.0.0.1:4222"
    instance_id: Annotated[str, _d("this instance's id on the bus; empty: <service>-<random>")] = ""
    http_host: Annotated[str, _d("address of the side port (/health, /ready, /metrics, /settings)")] = (
        "0.0.0.0"
    )
    http_port: Annotated[int, _d("side port; 0: off, -1: any free port", ge=-1, le=65535)] = 0
    ports_file: Annotated[str, _d("where to write the bound ports as JSON once serving; empty: nowhere")] = ""
    drain_timeout_s: Annotated[float, _d("seconds in-flight work may take to finish on shutdown", ge=0)] = (
        10.0
    )
    connect_timeout_s: Annotated[float, _d("seconds to wait for NATS at start", gt=0)] = 30.0
    log_level: Annotated[str, _d("Python log level")] = "INFO"
    event_loop: Annotated[
        Literal["auto", "uvloop", "asyncio"], _d("event loop: auto takes uvloop when installed, else asyncio")
    ] = "auto"
    gc_freeze: Annotated[bool, _d("freeze the start-up heap once set up (gc.freeze), as vLLM does")] = True
    heap_report_s: Annotated[
        float, _d("every this many seconds, log RSS and the allocators' heap with their growth; 0: off", ge=0)
    ] = 0.0
    heap_report_frames: Annotated[
        int,
        _d(
            "with heap_report_s: trace allocations (tracemalloc, this many frames) and log the lines grown most",
            ge=0,
        ),
    ] = 0
    malloc_trim_s: Annotated[
        float,
        _d(
            "every this many seconds, return glibc's freed-but-kept heap to the OS (malloc_trim); 0: off",
            ge=0,
        ),
    ] = 0.0
    malloc_arena_max: Annotated[
        int,
        _d(
            "glibc malloc arenas at most (mallopt M_ARENA_MAX, as MALLOC_ARENA_MAX); 0: glibc's default", ge=0
        ),
    ] = 0

    def arena_max(self) -> int:
        """The arena bound to set at start (0: leave glibc's)."""
        return self.malloc_arena_max

    nats_user: Annotated[str, _d("NATS user (with nats_password)")] = ""
    nats_password: Annotated[str, _d("NATS password (secret)")] = ""
    nats_token: Annotated[str, _d("NATS token (secret)")] = ""
    nats_tls_ca: Annotated[str, _d("CA file to verify the NATS server with")] = ""
    nats_tls_cert: Annotated[str, _d("client certificate for mutual TLS")] = ""
    nats_tls_key: Annotated[str, _d("client key for mutual TLS")] = ""

    def __repr__(self) -> str:
        return redacted_repr(self)


def env_prefix(service: str) -> str:
    """ "broker" / "MOEMESH_BROKER" / "MOEMESH_BROKER_" -> "MOEMESH_BROKER_"."""
    p = service.upper().replace("-", "_")
    if not p.startswith("MOEMESH_"):
        p = "MOEMESH_" + p
    return p if p.endswith("_") else p + "_"


def section_of(prefix: str) -> str:
    """The config-file section of a service: "MOEMESH_KV_BROKER_" / "kv-broker" -> "kv-broker"."""
    return env_prefix(prefix).removeprefix("MOEMESH_").rstrip("_").lower().replace("_", "-")


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One setting as docs and help show it."""

    name: str
    type: Any  # without Annotated
    default: Any  # msgspec.NODEFAULT / dataclasses.MISSING when required
    description: str


def describe(cls: type) -> list[FieldDoc]:
    """Every field of a settings class with its default and its `Meta(description=...)`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for name in _fields(cls):
        desc = " ".join(
            m.description
            for m in typing.get_args(hints[name])[1:]
            if isinstance(m, msgspec.Meta) and m.description
        )
        out.append(FieldDoc(name, _base_type(hints[name]), _default(cls, name), desc))
    return out


def _default(cls: type, name: str) -> Any:
    if dataclasses.is_dataclass(cls):
        d = {f.name: f for f in dataclasses.fields(cls)}[name]
        factory: Any = d.default_factory
        return factory() if factory is not dataclasses.MISSING else d.default
    m = {f.name: f for f in msgspec.structs.fields(cls)}[name]  # type: ignore[arg-type]
    return m.default_factory() if m.default_factory is not msgspec.NODEFAULT else m.default


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


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def aliases_of(cls: type, name: str) -> tuple[str, ...]:
    """The alias flags of a field ("--block-size" for page_size), as the class declares them."""
    return tuple(flag_of(a) for a in getattr(cls, "FLAG_ALIASES", {}).get(name, ()))


def read_config(path: str | Path) -> dict[str, Any]:
    """The config file as a mapping, its top-level keys checked (LAUNCHER_KEYS, ENGINE_KEYS, SECTIONS)."""
    import yaml  # only a process given a file needs it

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise SettingsError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    known = set(LAUNCHER_KEYS) | set(ENGINE_KEYS) | set(SECTIONS)
    for key, value in data.items():
        if key not in known:
            raise SettingsError(
                f"unknown key {key!r} in config file {path}; top-level keys: `moemesh up` options "
                f"({', '.join(LAUNCHER_KEYS)}), worker settings ({', '.join(ENGINE_KEYS)}), "
                f"sections ({', '.join(SECTIONS)})"
            )
        if key in SECTIONS and not isinstance(value, dict | None):
            raise SettingsError(f"config file {path}: section {key!r} must be a mapping of settings")
    return data


def config_values(path: str | Path, section: str, fields: Collection[str]) -> dict[str, tuple[str, Any]]:
    """What the file sets for one service: the top-level ENGINE_KEYS it has, then its section (wins).
    Returns field -> (where, value); a key of the section that names no field is a SettingsError."""
    data = read_config(path)
    out = {k: (f"{path}: {k}", data[k]) for k in ENGINE_KEYS if k in data and k in fields}
    for key, value in (data.get(section) or {}).items():
        if key not in fields:
            raise SettingsError(
                f"unknown key {key!r} in section {section!r} of config file {path}; known: {', '.join(fields)}"
            )
        out[key] = (f"{path}: {section}.{key}", value)
    return out


def load_settings(
    cls: type[S], prefix: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> S:
    """Build `cls` (a frozen msgspec Struct or dataclass) from flags > env vars > config file > defaults;
    `prefix` ("kv-broker" or "MOEMESH_KV_BROKER_") also names the file's section; `argv` defaults to no flags,
    `env` to os.environ. Raises SettingsError naming the offending key, flag, file or value."""
    fields = _fields(cls)
    prefix = env_prefix(prefix)
    env = os.environ if env is None else env
    config, flags = _parse_flags(cls, fields, prefix, list(argv or []))
    config = config or env.get(CONFIG_ENV, "")
    raw: dict[str, tuple[str, Any]] = {}  # field -> (source, value); str values are parsed below
    if config:
        raw.update(config_values(config, section_of(prefix), fields))
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
    raw.update(flags)
    values: dict[str, Any] = {}
    for name, (source, value) in raw.items():
        try:
            values[name] = _parse(fields[name], value) if isinstance(value, str) else value
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
) -> tuple[str, dict[str, tuple[str, str]]]:
    """(--config FILE or "", field -> (flag, value) for the flags given)."""
    parser = argparse.ArgumentParser(description=f"{cls.__name__} (env prefix {prefix})", allow_abbrev=False)
    parser.add_argument("--config", default="", metavar="FILE", help=f"YAML config file (env {CONFIG_ENV})")
    for doc in describe(cls):
        flags = (flag_of(doc.name), *aliases_of(cls, doc.name))
        help_ = doc.description.replace("%", "%%") or None
        if doc.type is bool:
            parser.add_argument(
                *flags, dest=doc.name, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            parser.add_argument(
                *flags, dest=doc.name, default=None, metavar=prefix + doc.name.upper(), help=help_
            )
    ns, extra = parser.parse_known_args(argv)
    if extra:
        raise SettingsError(f"unknown command-line arguments for {cls.__name__}: {' '.join(extra)}")
    out: dict[str, tuple[str, str]] = {}
    for name, value in vars(ns).items():
        if value is not None and name != "config":
            out[name] = (flag_of(name), str(value).lower() if isinstance(value, bool) else value)
    return ns.config, out


def settings_json(settings: Any) -> dict[str, Any]:
    """A settings object as JSON builtins, secrets masked and URLs redacted (the side port's /settings)."""
    out = msgspec.to_builtins(settings)
    for name, value in out.items():
        if is_secret(name) and value:
            out[name] = MASK
        elif name.endswith("url") and isinstance(value, str):
            out[name] = redact_url(value)
    return out


def _sources(err: str, raw: dict[str, tuple[str, Any]]) -> str:
    for name, (source, value) in raw.items():
        if f"$.{name}`" in err:
            return f" (from {source}={_shown(name, value)})"
    return ""


def _shown(name: str, value: Any) -> str:
    return MASK if is_secret(name) else repr(value)
