"""`python -m libs.telemetry [SERVICE]`: where SERVICE's traces would go with this environment (a check for
compose files, manifests and `moemesh up`, which pass the OTEL_* variables on to every service)."""

from __future__ import annotations

import os
import sys

from libs.telemetry.tracing import otlp_config, otlp_endpoint


def main(argv: list[str]) -> int:
    service = argv[0] if argv else "service"
    try:
        cfg = otlp_config(os.environ)
    except ValueError as e:
        print(f"{service}: {e}", file=sys.stderr)
        return 2
    if cfg is None:
        print(f"{service}: tracing off (no OTEL_EXPORTER_OTLP_ENDPOINT, or disabled)")
        return 0
    kind, protocol = cfg
    print(f"{service}: {kind} {protocol} {otlp_endpoint(os.environ)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
