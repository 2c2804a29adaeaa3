"""The NATS layer services share: typed messaging (Bus), header context, settings, the service shell."""

from libs.bus.bus import (
    Bus,
    BusError,
    DeadlineExceeded,
    Handler,
    NoResponders,
    PayloadTooLarge,
    RequestRejected,
    RequestTimeout,
)
from libs.bus.service import Service
from libs.bus.settings import ServiceSettings, SettingsError, env_prefix, load_settings
from libs.telemetry.context import (
    DEADLINE,
    TRACEPARENT,
    current_deadline,
    current_traceparent,
    new_traceparent,
    now_ms,
    request_context,
    time_left,
)

__all__ = [
    "DEADLINE",
    "TRACEPARENT",
    "Bus",
    "BusError",
    "DeadlineExceeded",
    "Handler",
    "NoResponders",
    "PayloadTooLarge",
    "RequestRejected",
    "RequestTimeout",
    "Service",
    "ServiceSettings",
    "SettingsError",
    "current_deadline",
    "current_traceparent",
    "env_prefix",
    "load_settings",
    "new_traceparent",
    "now_ms",
    "request_context",
    "time_left",
]
