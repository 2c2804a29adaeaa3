"""The gateway's per-token metrics (StreamTally) expose what prometheus_client's Counter and Histogram
would for the same observations: same names, buckets, counts and sum."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.gateway.metrics import _ITL, GatewayMetrics


def _samples(text: bytes, prefix: str) -> dict[str, float]:
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(prefix) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_tally_matches_counter_and_histogram() -> None:
    gw = GatewayMetrics()
    ref = CollectorRegistry()
    hist = Histogram("moemesh_gateway_itl_seconds", "x", buckets=_ITL, registry=ref)
    tokens = Counter("moemesh_gateway_generation_tokens", "x", registry=ref)
    for gap, n in [(0.0005, 1), (0.0004, 2), (0.003, 1), (0.01, 3), (2.5, 1), (7.0, 2), (0.0, 1)]:
        gw.tally.itl(gap, n)  # bounds themselves included: a bound's own value falls in its bucket
        for _ in range(n):
            hist.observe(gap)
    gw.tally.tokens += 11
    tokens.inc(11)
    for prefix in ("moemesh_gateway_itl_seconds", "moemesh_gateway_generation_tokens"):
        got, want = _samples(generate_latest(gw.registry), prefix), _samples(generate_latest(ref), prefix)
        assert got == want and got
