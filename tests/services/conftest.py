"""Fixtures of the service tests (a module's own nats-server: tests/conftest.py's `private_nats_url`)."""
