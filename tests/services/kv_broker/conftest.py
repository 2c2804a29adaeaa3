"""Fixtures of the kv-broker tests."""

from __future__ import annotations

import pytest

from libs.bus import Bus


@pytest.fixture
async def client(nats_server):
    """A bus connection of the test's own, to talk to a broker as workers and the scheduler do."""
    bus = await Bus.connect(nats_server, "kv-broker-test-client")
    yield bus
    await bus.close()
