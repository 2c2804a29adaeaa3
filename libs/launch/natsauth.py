"""NATS security for the embedded mesh: what the local nats-server requires and what every service (and
test client) is given. The server's settings go into a config file only its owner can read (`-c`), not
onto its command line, and `repr` never shows a secret."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.bus.security import MASK, nats_connect_options
from libs.bus.settings import ServiceSettings


@dataclass(frozen=True)
class NatsAuth:
    """user + password, or token; optional TLS: the server presents `tls_cert`/`tls_key`, clients
    verify it with `tls_ca`."""

    user: str = ""
    password: str = ""
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def __post_init__(self) -> None:
        if self.token and (self.user or self.password):
            raise ValueError("NATS auth: set a token or a user/password, not both")
        if bool(self.user) != bool(self.password):
            raise ValueError("NATS auth: a user needs a password (and a password a user)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("NATS TLS: the server needs both tls_cert and tls_key")

    def __repr__(self) -> str:
        secret = "password" if self.password else "token" if self.token else "none"
        return f"NatsAuth(user={self.user!r}, secret={secret}:{MASK}, tls={bool(self.tls_cert)})"

    def server_args(self, workdir: Path) -> list[str]:
        """nats-server arguments: a 0600 config file holding the authorization and TLS blocks."""
        lines = []
        if self.user:
            lines += [
                "authorization {",
                f"  user: {json.dumps(self.user)}",
                f"  password: {json.dumps(self.password)}",
                "}",
            ]
        elif self.token:
            lines += ["authorization {", f"  token: {json.dumps(self.token)}", "}"]
        if self.tls_cert:
            lines += [
                "tls {",
                f"  cert_file: {json.dumps(self.tls_cert)}",
                f"  key_file: {json.dumps(self.tls_key)}",
                "}",
            ]
        if not lines:
            return []
        path = Path(workdir) / "nats-auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return ["-c", str(path)]

    def client_env(self) -> dict[str, str]:
        """The shared MOEMESH_NATS_* settings every service reads (libs.bus.settings)."""
        env = {
            "MOEMESH_NATS_USER": self.user,
            "MOEMESH_NATS_PASSWORD": self.password,
            "MOEMESH_NATS_TOKEN": self.token,
        }
        if self.tls_ca:
            env["MOEMESH_NATS_TLS_CA"] = self.tls_ca
        return {k: v for k, v in env.items() if v}

    def client_options(self) -> dict[str, Any]:
        """nats-py connect options for a client outside the services (tests, benchmarks): what a
        service given `client_env()` connects with."""
        s = ServiceSettings(
            nats_user=self.user, nats_password=self.password, nats_token=self.token, nats_tls_ca=self.tls_ca
        )
        return nats_connect_options(s)
