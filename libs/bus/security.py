"""NATS credentials and TLS for every service (`nats_connect_options`: MOEMESH_NATS_USER/_PASSWORD/_TOKEN,
MOEMESH_NATS_TLS_CA/_CERT/_KEY -> nats-py options), and secrets kept out of logs: settings print secret
fields as '***' (`redacted_repr`), URLs print without password or token (`redact_url`)."""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

MASK = "***"
# field names whose values are secrets, wherever they appear in a settings object (and, by suffix in
# is_secret, any "<x>_password", "<x>_token", "<x>_secret", "<x>_api_key")
SECRET_FIELDS = frozenset({"api_key", "password", "token", "secret"})


def is_secret(name: str) -> bool:
    return name in SECRET_FIELDS or name.endswith(("_password", "_token", "_secret", "_api_key"))


def redact_url(url: str) -> str:
    """nats://user:pass@host:4222 -> nats://user:***@host:4222; nats://token@host -> nats://***@host.
    A comma-separated server list is redacted server by server."""
    if "," in url:
        return ",".join(redact_url(u.strip()) for u in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, sep, _ = userinfo.partition(":")
    safe = f"{user}:{MASK}" if sep else MASK
    return urlunsplit(parts._replace(netloc=f"{safe}@{hostport}"))


def redacted_repr(obj: msgspec.Struct) -> str:
    """`Name(field=value, ...)` with secret fields masked and URLs redacted."""
    items = []
    for f in msgspec.structs.fields(obj):
        value = getattr(obj, f.name)
        if is_secret(f.name) and value:
            shown = MASK
        elif f.name.endswith("url") and isinstance(value, str):
            shown = repr(redact_url(value))
        else:
            shown = repr(value)
        items.append(f"{f.name}={shown}")
    return f"{type(obj).__name__}({', '.join(items)})"


def tls_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext | None:
    """A client TLS context: verify the server with `ca` (else the system store), present `cert`/`key`
    for mutual TLS. None when nothing is configured (plain TCP unless the URL says tls://)."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("NATS TLS needs both a client certificate and its key (nats_tls_cert, nats_tls_key)")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def nats_connect_options(s: Any) -> dict[str, Any]:
    """nats-py connect options from a ServiceSettings (only what is set)."""
    if s.nats_token and (s.nats_user or s.nats_password):
        raise ValueError("set either a NATS token or a NATS user/password, not both")
    opts: dict[str, Any] = {}
    if s.nats_user:
        opts["user"], opts["password"] = s.nats_user, s.nats_password
    if s.nats_token:
        opts["token"] = s.nats_token
    ctx = tls_context(s.nats_tls_ca, s.nats_tls_cert, s.nats_tls_key)
    if ctx is not None:
        opts["tls"] = ctx
    return opts
