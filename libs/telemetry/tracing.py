"""OpenTelemetry tracing for one service, joined across processes through the bus's `traceparent`."""

# Each service owns a `Telemetry` (the Service shell makes one from the environment). Spans are started
# as children of the W3C `traceparent` in force (libs.telemetry.context: the one that came in the NATS headers
# of the message being handled), and while a span is open *its* context is the traceparent in force, so
# every message sent from inside it carries it on: one request is one trace across every process.
#
# Configuration is OpenTelemetry's own environment (read by the SDK and the OTLP exporters themselves):
# - `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`: export is on only when one is set
#   (or `OTEL_TRACES_EXPORTER=console`); otherwise `Telemetry` is a no-op whose spans cost an attribute
#   check and nothing is imported from the SDK.
# - `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf` (default) or `grpc`.
# - `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn tracing off; `OTEL_TRACES_SAMPLER`,
#   `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS` / `_TIMEOUT` / `_INSECURE` and `OTEL_RESOURCE_ATTRIBUTES` work
#   as documented by OpenTelemetry. `service.name` is always the service's own (gateway, scheduler,
#   kv-broker, prefill-worker, decode-worker), so one environment can be shared by every container.
#
# A disabled service still passes the incoming traceparent on unchanged, so a traced service downstream
# of an untraced one stays in the caller's trace.

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from libs.telemetry.context import TRACEPARENT, context_from_headers, current_traceparent, request_context

log = logging.getLogger("moemesh.telemetry")

PROTOCOLS = ("http/protobuf", "grpc")
_TRUE = ("1", "true", "yes", "on")


class _Current:
    def __repr__(self) -> str:
        return "CURRENT"


CURRENT: Any = _Current()  # `parent=CURRENT`: the traceparent in force (libs.telemetry.context)

# str, bool, int, float or a list of one of those (OpenTelemetry's rule; the SDK drops anything else)
AttributeValue = Any


def traceparent_of(span: Span) -> str | None:
    """The W3C traceparent naming `span` (what goes in the NATS headers), or None for a no-op span."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parent_context(traceparent: str | None) -> Any:
    """An OpenTelemetry Context whose (remote) parent is `traceparent`; an empty one (a root) for None or
    a malformed value."""
    tp, _ = context_from_headers({TRACEPARENT: traceparent} if traceparent else None)
    if tp is None:
        return trace.set_span_in_context(INVALID_SPAN)  # explicit root, never the ambient OTel span
    _, trace_id, span_id, flags = tp.split("-")
    ctx = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def mark_error(span: Span, error: BaseException | str) -> None:
    """Set ERROR status on a span for a failure the code handled itself (no exception escaped the span)."""
    if isinstance(error, BaseException):
        span.record_exception(error)
        error = f"{type(error).__name__}: {error}"
    span.set_status(Status(StatusCode.ERROR, str(error)[:500]))


def annotate(**attributes: AttributeValue | None) -> None:
    """Set attributes on the span open in this context (a no-op when none is, or tracing is off).
    Keys use `__` for `.`: `annotate(moemesh__cached_tokens=3)` sets `moemesh.cached_tokens`."""
    span = trace.get_current_span()
    if span.is_recording():
        for k, v in attributes.items():
            if v is not None:
                span.set_attribute(k.replace("__", "."), v)


def otlp_endpoint(env: Mapping[str, str]) -> str:
    """Where OTLP traces go: the traces-only endpoint, else the general one; "" when neither is set."""
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""


def otlp_config(env: Mapping[str, str]) -> tuple[str, str] | None:
    """("otlp", protocol) or ("console", "") when traces should be exported, None when not.
    Raises ValueError for a protocol or exporter this build does not speak."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    exporters = [x.strip().lower() for x in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if x.strip()]
    if not exporters or exporters == ["none"]:
        return None
    if exporters == ["console"]:
        return ("console", "")
    if exporters != ["otlp"]:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: moemesh exports otlp, console or none"
        )
    if not otlp_endpoint(env):
        return None
    key = (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = env.get(key, "").strip().lower() or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{key}={protocol!r}: moemesh exports OTLP over {' or '.join(PROTOCOLS)}")
    return ("otlp", protocol)


def make_exporter(kind: str, protocol: str) -> Any:
    """The SDK span exporter for otlp_config()'s answer; it reads its endpoint, headers and timeout
    from the OTEL_EXPORTER_OTLP_* environment itself."""
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


class _PassThrough:
    """The span of a disabled Telemetry: no span, but an explicit parent still becomes the traceparent
    in force, exactly as `request_context(traceparent=parent)` would."""

    __slots__ = ("_cm", "_parent")

    def __init__(self, parent: Any) -> None:
        self._parent = parent
        self._cm: Any = None

    def __enter__(self) -> Span:
        if self._parent is not CURRENT and self._parent is not None:
            self._cm = request_context(traceparent=self._parent)
            self._cm.__enter__()
        return INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)


class Telemetry:
    """One service's tracer. Build with `from_env(service)` (the environment decides) or
    `with_exporter(service, exporter)` (tests, tools); `Telemetry.disabled(service)` traces nothing."""

    def __init__(self, service_name: str, provider: Any = None) -> None:
        self.service_name = service_name
        self.provider = provider  # an SDK TracerProvider, or None when disabled
        self.tracer: Any = provider.get_tracer("moemesh") if provider is not None else None

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @classmethod
    def disabled(cls, service_name: str = "") -> Telemetry:
        return cls(service_name)

    @classmethod
    def from_env(
        cls, service_name: str, instance_id: str = "", env: Mapping[str, str] | None = None
    ) -> Telemetry:
        """Export over OTLP when the environment configures an endpoint (module docstring); else disabled.
        A misconfiguration (unknown protocol) raises ValueError naming the variable."""
        env = os.environ if env is None else env
        cfg = otlp_config(env)
        if cfg is None:
            return cls.disabled(service_name)
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = _provider(service_name, instance_id)
        provider.add_span_processor(BatchSpanProcessor(make_exporter(*cfg)))
        log.info("%s: exporting traces (%s %s)", service_name, cfg[0], cfg[1])
        return cls(service_name, provider)

    @classmethod
    def with_exporter(
        cls, service_name: str, exporter: Any, instance_id: str = "", batch: bool = False
    ) -> Telemetry:
        """Spans go to `exporter` (e.g. an InMemorySpanExporter), synchronously unless `batch`."""
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = _provider(service_name, instance_id)
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(service_name, provider)

    # --- spans ---
    def start_span(
        self,
        name: str,
        *,
        parent: Any = CURRENT,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        start_time_ns: int | None = None,
        root: bool = True,
    ) -> Span:
        """A span the caller ends (`span.end()`), for work that outlives one handler (a decoding request).
        `parent`: a traceparent, None (a new trace), or CURRENT. With `root=False` no span is made when
        there is no parent (work outside any request, e.g. registrations). INVALID_SPAN when disabled."""
        if self.tracer is None:
            return INVALID_SPAN
        tp = current_traceparent() if parent is CURRENT else parent
        if tp is None and not root:
            return INVALID_SPAN
        return self.tracer.start_span(
            name, context=parent_context(tp), kind=kind, attributes=attributes, start_time=start_time_ns
        )

    def span(
        self,
        name: str,
        *,
        parent: Any = CURRENT,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        start_time_ns: int | None = None,
        root: bool = True,
    ) -> contextlib.AbstractContextManager[Span]:
        """`with telemetry.span(...) as span:` — a child of `parent` (see start_span) whose context is the
        traceparent in force inside the block (so bus messages sent there are its children). An exception
        leaving the block is recorded and sets ERROR. Disabled: no span, `parent` passed on unchanged."""
        if self.tracer is None:
            return _PassThrough(parent)
        return self._span(self.start_span(
            name, parent=parent, kind=kind, attributes=attributes, start_time_ns=start_time_ns, root=root
        ))  # fmt: skip

    @contextlib.contextmanager
    def _span(self, span: Span) -> Iterator[Span]:
        with use_span(span, end_on_exit=True):
            yield span

    # --- shutdown ---
    def shutdown(self) -> None:
        """Export what is buffered and stop (bounded by OTEL_BSP_EXPORT_TIMEOUT); idempotent."""
        provider, self.provider, self.tracer = self.provider, None, None
        if provider is not None:
            try:
                provider.shutdown()
            except Exception as e:  # an unreachable collector must not fail a shutdown
                log.warning("%s: trace export at shutdown failed: %s", self.service_name, e)

    async def aclose(self, timeout: float = 5.0) -> None:
        """shutdown() off the event loop, waiting at most `timeout` s."""
        if self.provider is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.to_thread(self.shutdown), timeout)


@contextlib.contextmanager
def use_span(span: Span, end_on_exit: bool = False) -> Iterator[Span]:
    """Make `span` current for the block: the OpenTelemetry current span (annotate()) and the traceparent
    in force (outgoing bus headers). No-op spans leave the context as it is."""
    tp = traceparent_of(span)
    if tp is None:
        yield span
        if end_on_exit:
            span.end()
        return
    with trace.use_span(span, end_on_exit=end_on_exit), request_context(traceparent=tp):
        yield span


def _provider(service_name: str, instance_id: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    attrs: dict[str, str] = {"service.name": service_name, "service.namespace": "moemesh"}
    if instance_id:
        attrs["service.instance.id"] = instance_id
    return TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
