"""Fixtures of the service tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.natsd import start_nats_server


@pytest.fixture(scope="module")
def private_nats_url() -> Iterator[str]:
    """A nats-server of the test module's own (no JetStream): a broker double answering on the mesh's one
    broker subject sees no other module's traffic."""
    server = start_nats_server(jetstream=False)
    try:
        yield server.url
    finally:
        server.stop()
