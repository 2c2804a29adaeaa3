"""A local nats-server for the embedded default and the tests (`start_nats_server`)."""

from libs.natsd.server import NatsServer, NatsServerError, find_nats_server_binary, start_nats_server

__all__ = ["NatsServer", "NatsServerError", "find_nats_server_binary", "start_nats_server"]
