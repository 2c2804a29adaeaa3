"""The wire contract every service shares: messages (proto.messages) and subjects (proto.subjects).
Imports nothing of ours. `encode`/`decoder` are the only way bytes are made from or read into messages."""

from __future__ import annotations

from typing import Any

import msgspec

from proto.messages import SCHEMA_VERSION

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class SchemaVersionError(ValueError):
    pass


class Decoder:
    """Decoder for one message type (a Struct or a union of tagged Structs), built once per subject."""

    def __init__(self, typ: Any) -> None:
        self._dec = msgspec.msgpack.Decoder(typ)

    def decode(self, data: bytes) -> Any:
        msg = self._dec.decode(data)
        v = getattr(msg, "v", SCHEMA_VERSION)
        if v > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"message {type(msg).__name__} has schema version {v}, this service reads up to {SCHEMA_VERSION}"
            )
        return msg


def decoder(typ: Any) -> Decoder:
    return Decoder(typ)


__all__ = ["SCHEMA_VERSION", "Decoder", "SchemaVersionError", "decoder", "encode"]
