"""Observability shared by every service: OpenTelemetry tracing joined through the bus's traceparent
(tracing.py), per-request spans and outcome metrics of workers (requests.py), the gateway's HTTP span
and latency metrics (asgi.py) and span attributes from bus messages (attributes.py)."""

from libs.telemetry.requests import RequestTracker, reason_of
from libs.telemetry.tracing import (
    CURRENT,
    Telemetry,
    annotate,
    mark_error,
    otlp_config,
    parent_context,
    traceparent_of,
    use_span,
)

__all__ = [
    "CURRENT",
    "RequestTracker",
    "Telemetry",
    "annotate",
    "mark_error",
    "otlp_config",
    "parent_context",
    "reason_of",
    "traceparent_of",
    "use_span",
]
