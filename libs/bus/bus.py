"""The NATS layer every service shares: typed publish, request/reply and subscriptions of proto Structs.
A handler's returned Struct is the reply; a raising handler or an undecodable message is answered `Rejected`
(503 for a newer schema version) and the subscription goes on. Messages carry trace context and deadline."""

# Handlers are `async def handler(msg) -> Struct | None`. `request()` turns a `Rejected` answer back into
# `RequestRejected`, and bounds its wait by the deadline in force. `request_local()` shares the answer path
# (`_answer`) with the bus, so a service hosting another in its own loop sees the same replies and errors.

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import typing
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CollectorRegistry, Counter, Histogram

from libs.bus.security import redact_url
from libs.telemetry.context import incoming_context, now_ms, outgoing_headers, time_left
from proto import Decoder, SchemaVersionError, encode
from proto.messages import ErrorCode, Rejected

log = logging.getLogger("moemesh.bus")

T = TypeVar("T")
Handler = Callable[[Any], Awaitable[msgspec.Struct | None]]


class BusError(Exception):
    """Base of the bus layer's errors."""


class PayloadTooLarge(BusError, ValueError):
    """The encoded message exceeds the server's max_payload; nothing was sent."""


class NoResponders(BusError):
    """Nobody subscribes to the subject of a request."""


class RequestTimeout(BusError, TimeoutError):
    """No reply before the timeout (or the deadline in force)."""


class DeadlineExceeded(RequestTimeout):
    """The deadline in force had already passed; nothing was sent."""


class RequestRejected(BusError):
    """A refusal with an HTTP-like code. Raise it in a handler to answer with `Rejected(code, message)`;
    `request()` raises it when the answer is a `Rejected`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = int(code)
        self.message = message


WRITE_NOW_MAX_BUFFERED = 1 << 20  # bytes in the socket's buffer past which write_pending leaves it to nats-py


@functools.cache
def _decoder(typ: Any) -> Decoder:
    return Decoder(typ)


@functools.cache
def _reply_decoder(reply_type: Any) -> Decoder:
    return Decoder(typing.Union[reply_type, Rejected])  # noqa: UP007 - reply_type may itself be a union


def _reply(data: bytes, reply_type: Any, msg: msgspec.Struct, subject: str) -> Any:
    """A request's answer: the typed reply, or the receiver's `Rejected` raised as `RequestRejected`."""
    try:
        reply = _reply_decoder(reply_type).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, SchemaVersionError) as e:
        raise BusError(f"reply to {type(msg).__name__} on {subject} does not decode: {e}") from e
    if isinstance(reply, Rejected):
        raise RequestRejected(reply.code, reply.message)
    return reply


def _header_bytes(headers: dict[str, str] | None) -> int:
    if not headers:
        return 0
    return len("NATS/1.0\r\n\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items())


class Bus:
    """One NATS connection with typed messaging. Build with `await Bus.connect(url, name)`."""

    def __init__(self, nc: Client, name: str, registry: CollectorRegistry | None = None) -> None:
        self.nc = nc
        self.name = name
        self.registry = registry
        self._subs: list[Subscription] = []
        self._inflight: set[asyncio.Task] = set()
        self._msgs: Counter | None = None
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._seconds: Histogram | None = None
        if registry is not None:
            self._msgs = Counter(
                "moemesh_bus_messages", "Messages handled, by subscription and outcome",
                ["subscription", "outcome"], registry=registry,
            )  # fmt: skip
            self._seconds = Histogram(
                "moemesh_bus_handler_seconds",
                "Handler time by subscription",
                ["subscription"],
                registry=registry,
            )

    @classmethod
    async def connect(
        cls,
        url: str | list[str],
        name: str,
        *,
        connect_deadline: float = 30.0,
        reconnect_time_wait: float = 0.5,
        drain_timeout: float = 10.0,
        registry: CollectorRegistry | None = None,
        **auth: Any,
    ) -> Bus:
        """Connect, retrying until `connect_deadline` seconds pass (a server that is still starting is
        fine); afterwards reconnect forever, logging each disconnect and reconnect. `auth`: nats-py's
        user / password / token / tls options (libs.bus.security.nats_connect_options)."""
        nc = Client()

        async def on_error(e: Exception) -> None:
            log.warning("nats %s: %s: %s", name, type(e).__name__, e)

        async def on_disconnect() -> None:
            log.warning("nats %s: disconnected", name)

        async def on_reconnect() -> None:
            where = nc.connected_url.netloc.rpartition("@")[2] if nc.connected_url else "?"  # no credentials
            log.info("nats %s: reconnected to %s", name, where)

        async def on_closed() -> None:
            log.info("nats %s: connection closed", name)

        opts: dict[str, Any] = dict(  # seconds as floats: nats-py annotates them int but sleeps on them
            name=name, max_reconnect_attempts=-1, reconnect_time_wait=reconnect_time_wait, connect_timeout=2,
            drain_timeout=drain_timeout, error_cb=on_error, disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect, closed_cb=on_closed, **auth,
        )  # fmt: skip
        try:
            await asyncio.wait_for(nc.connect(url, **opts), connect_deadline)
        except TimeoutError:
            await nc.close()
            shown = redact_url(url if isinstance(url, str) else ",".join(url))
            raise BusError(f"could not connect to NATS at {shown} within {connect_deadline}s") from None
        return cls(nc, name, registry)

    # --- state ---
    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    @property
    def reconnects(self) -> int:
        """How often the connection came back (messages may have been lost each time)."""
        return int(self.nc.stats.get("reconnects", 0))

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    def jetstream(self) -> Any:
        """The JetStream context of this connection (KV buckets, streams)."""
        return self.nc.jetstream()

    # --- sending ---
    def _checked(self, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None) -> bytes:
        data = encode(msg)
        size = len(data) + _header_bytes(headers)
        if size > self.nc.max_payload:
            raise PayloadTooLarge(
                f"{type(msg).__name__} for {subject} is {size} bytes, over the server's max_payload of "
                f"{self.nc.max_payload} bytes; nothing was sent"
            )
        return data

    async def publish(self, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None = None) -> None:
        """Fire-and-forget publish of one message, with the current trace context and deadline."""
        hdrs = outgoing_headers(headers)
        await self.nc.publish(subject, self._checked(subject, msg, hdrs), headers=hdrs)

    async def publish_now(
        self, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None = None
    ) -> None:
        """publish, handed to the socket before returning (`write_pending`; no server round trip like
        flush()): for a message on the TTFT path whose publisher goes on working, or that must leave before
        something that blocks the process, such as a KV write (Mooncake holds the GIL during a call)."""
        await self.publish(subject, msg, headers)
        self.write_pending()

    def write_pending(self) -> None:
        """Hand what this connection has queued to the socket now, rather than after whatever the publishing
        task does next (nats-py's writer task sends on a later loop turn). Leaves the queue to that task when
        not connected, on a non-TCP transport, with WRITE_NOW_MAX_BUFFERED bytes already buffered, or on a
        socket that closed before nats-py noticed (its reconnect sends the queue). Never raises."""
        nc = self.nc
        pending = getattr(nc, "_pending", None)
        transport = getattr(nc, "_transport", None)
        sock = getattr(getattr(transport, "_io_writer", None), "transport", None)
        if not pending or transport is None or sock is None or not nc.is_connected or sock.is_closing():
            return
        if sock.get_write_buffer_size() >= WRITE_NOW_MAX_BUFFERED:
            return
        try:
            transport.writelines(pending[:])
        except (RuntimeError, OSError):  # closed under us (uvloop raises RuntimeError): the queue stays
            return
        nc._pending = []
        nc._pending_data_size = 0

    async def request(
        self,
        subject: str,
        msg: msgspec.Struct,
        reply_type: type[T] | Any,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> T:
        """Send and wait for one typed reply, for at most `timeout` s and never past the deadline in force.
        Raises DeadlineExceeded (nothing sent), RequestTimeout, NoResponders, RequestRejected (the receiver
        answered Rejected), PayloadTooLarge, or BusError for a reply that does not decode."""
        timeout, hdrs, data = self._outgoing_request(subject, msg, timeout, headers, "not sent to")
        try:
            resp = await self.nc.request(subject, data, timeout=timeout, headers=hdrs)
        except nats.errors.NoRespondersError:
            raise NoResponders(f"no subscriber for {subject} ({type(msg).__name__})") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(
                f"no reply to {type(msg).__name__} on {subject} within {timeout:.3f}s"
            ) from None
        return _reply(resp.data, reply_type, msg, subject)

    async def request_local(
        self,
        subject: str,
        msg_type: Any,
        handler: Handler,
        msg: msgspec.Struct,
        reply_type: type[T] | Any,
        timeout: float = 5.0,
    ) -> T:
        """`request()` answered by `handler` of this process with no trip through NATS, with the same outcomes:
        wire encoding and checks, the receiver's context, `RequestRejected`/`RequestTimeout` (at once for a
        handler that returns nothing). The handler runs to its end regardless, counted in flight."""
        timeout, hdrs, data = self._outgoing_request(subject, msg, timeout, None, "not handled for")
        task = asyncio.create_task(self._answer_local(data, hdrs, subject, _decoder(msg_type), handler))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        try:
            async with asyncio.timeout(timeout):
                reply = await asyncio.shield(task)  # the caller stops waiting; the handler goes on
        except TimeoutError:
            raise RequestTimeout(
                f"no reply to {type(msg).__name__} on {subject} within {timeout:.3f}s (in process)"
            ) from None
        if reply is None:
            raise RequestTimeout(f"the handler of {subject} gave no reply to {type(msg).__name__}")
        return _reply(encode(reply), reply_type, msg, subject)

    def _outgoing_request(
        self, subject: str, msg: msgspec.Struct, timeout: float, headers: dict[str, str] | None, verb: str
    ) -> tuple[float, dict[str, str] | None, bytes]:
        """A request's wait bounded by the deadline in force (DeadlineExceeded once it passed), its headers
        telling the receiver when the caller stops waiting, and its checked payload."""
        left = time_left()
        if left is not None:
            if left <= 0:
                raise DeadlineExceeded(
                    f"deadline passed {-left:.3f}s ago; {type(msg).__name__} {verb} {subject}"
                )
            timeout = min(timeout, left)
        hdrs = outgoing_headers(headers, deadline_ms=now_ms() + int(timeout * 1000))
        return timeout, hdrs, self._checked(subject, msg, hdrs)

    async def _answer_local(
        self, data: bytes, headers: dict[str, str] | None, subject: str, dec: Decoder, handler: Handler
    ) -> msgspec.Struct | None:
        t0 = time.perf_counter()
        with incoming_context(headers):
            reply, outcome = await self._answer(data, subject, dec, handler)
        self._count(subject, outcome, t0)
        return reply

    async def flush(self, timeout: float = 5.0) -> None:
        await self.nc.flush(timeout)  # type: ignore[arg-type]

    # --- receiving ---
    async def subscribe(
        self,
        subject: str,
        msg_type: Any,
        handler: Handler,
        queue: str | None = None,
        *,
        concurrent: bool = False,
        max_in_flight: int = 256,
    ) -> Subscription:
        """Handle every message on `subject` (a queue group shares them among subscribers): one at a time in
        arrival order (a token stream), or with `concurrent=True` each in its own task, at most
        `max_in_flight` at once (request/reply handlers that wait on I/O)."""
        dec = _decoder(msg_type)
        if not concurrent:

            async def cb(m: Msg) -> None:
                await self._handle(m, dec, handler, subject)

        else:
            slots = asyncio.Semaphore(max_in_flight)

            async def cb(m: Msg) -> None:
                await slots.acquire()  # backpressure: holds this subscription's delivery, not the others
                task = asyncio.create_task(self._handle(m, dec, handler, subject))
                self._inflight.add(task)

                def done(t: asyncio.Task) -> None:
                    self._inflight.discard(t)
                    slots.release()

                task.add_done_callback(done)

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=cb)
        self._subs.append(sub)
        return sub

    async def _handle(self, m: Msg, dec: Decoder, handler: Handler, label: str) -> None:
        t0 = time.perf_counter()
        with incoming_context(m.headers):
            reply, outcome = await self._answer(m.data, m.subject, dec, handler)
            if isinstance(reply, Rejected):
                await self._reject(m, reply.code, reply.message)
            elif reply is not None and not m.reply:
                log.debug("%s handler returned %s but the message has no reply subject", label,
                          type(reply).__name__)  # fmt: skip
            elif reply is not None:
                try:
                    await self.publish(m.reply, reply)
                except Exception as e:
                    outcome = "error"
                    log.exception("reply to %s on %s could not be sent", type(reply).__name__, m.subject)
                    await self._reject(m, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        self._count(label, outcome, t0)

    async def _answer(
        self, data: bytes, subject: str, dec: Decoder, handler: Handler
    ) -> tuple[msgspec.Struct | None, str]:
        """What a requester gets for one message: the handler's reply, or the `Rejected` standing in for a
        message that does not decode or a handler that raised; with the outcome label for the metrics.
        The bus (`_handle`) and in-process requests (`request_local`) both answer through here."""
        try:
            msg = dec.decode(data)
        except SchemaVersionError as e:
            log.error("refused a message on %s from a newer service: %s (upgrade this one)", subject, e)
            return Rejected(
                code=int(ErrorCode.UNAVAILABLE), message=f"{self.name} cannot read it: {e}"
            ), "schema_version"
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("undecodable message on %s (%d bytes): %s", subject, len(data), e)
            message = f"cannot decode message on {subject}: {e}"
            return Rejected(code=int(ErrorCode.BAD_REQUEST), message=message[:2000]), "undecodable"
        try:
            return await handler(msg), "ok"
        except RequestRejected as e:
            log.info("%s on %s refused: %s", type(msg).__name__, subject, e)
            return Rejected(code=e.code, message=e.message[:2000]), "rejected"
        except Exception as e:
            log.exception("handler for %s failed on %s", subject, type(msg).__name__)
            return Rejected(code=int(ErrorCode.INTERNAL), message=f"{type(e).__name__}: {e}"[:2000]), "error"

    async def _reject(self, m: Msg, code: int, message: str) -> None:
        if not m.reply:
            return
        try:
            await self.publish(m.reply, Rejected(code=int(code), message=message[:2000]))
        except Exception as e:  # the connection may be gone; the requester's timeout covers it
            log.warning("could not send rejection to %s: %s", m.reply, e)

    def _count(self, label: str, outcome: str, t0: float) -> None:
        if self._msgs is None or self._seconds is None:
            return
        key = (label, outcome)
        children = self._children.get(key)  # labels() per message costs a lock and a tuple key each time
        if children is None:
            children = self._children[key] = (self._msgs.labels(label, outcome), self._seconds.labels(label))
        children[0].inc()
        children[1].observe(time.perf_counter() - t0)

    # --- shutdown ---
    @property
    def in_flight(self) -> int:
        """Handler tasks of concurrent subscriptions still running."""
        return len(self._inflight)

    async def stop_subscriptions(self, timeout: float) -> bool:
        """Stop taking new messages: unsubscribe every subscription, let the ones already delivered be
        handled, and wait up to `timeout` s for running handlers; cancel what is left.
        Returns True when everything finished in time."""
        deadline = time.monotonic() + timeout
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await asyncio.wait_for(sub.drain(), max(0.0, deadline - time.monotonic()))
            except (TimeoutError, nats.errors.Error) as e:
                log.warning("draining subscription %s: %s", sub.subject, type(e).__name__)
        clean = True
        if self._inflight:
            _, pending = await asyncio.wait(
                set(self._inflight), timeout=max(0.0, deadline - time.monotonic())
            )
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            clean = not pending
            if pending:
                log.warning("%d handlers still running at the drain deadline were cancelled", len(pending))
        return clean

    async def drain(self) -> None:
        """Flush what was published and close the connection (subscriptions drained first)."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except (nats.errors.Error, OSError, TimeoutError) as e:  # server gone, or drain_timeout hit
            log.warning("nats drain of %s: %s: %s", self.name, type(e).__name__, e)
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()
