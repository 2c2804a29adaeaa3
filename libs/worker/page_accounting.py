"""Page accounting for the leak check: `request_pages` = used - cached (pages only requests hold; the prefix
cache's are not leaks) and `leaked_pages` = request_pages while no request is alive, the gauge an alert
fires on. Once traffic stops, every worker reaches request_pages == 0."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge


def page_account(stats: Mapping[str, int]) -> dict[str, int]:
    """WorkerStats' page fields from an engine's `stats()`."""
    used, cached = int(stats["used_pages"]), int(stats.get("cached_pages", 0))
    live = sum(int(stats.get(k, 0)) for k in ("running", "waiting", "reserved", "pinned"))
    return {
        "used_pages": used,
        "cached_pages": cached,
        "request_pages": max(0, used - cached),
        "live_requests": live,
    }


def leaked_pages(account: Mapping[str, int]) -> int:
    return account["request_pages"] if account["live_requests"] == 0 else 0


def install_page_gauges(registry: CollectorRegistry, stats: Callable[[], Mapping[str, int]]) -> None:
    """Gauges read at scrape time: request pages, cached pages, live requests, leaked pages."""
    for name, doc, fn in (
        ("moemesh_kv_request_pages", "KV pages held by requests (prefix cache excluded)",
         lambda: page_account(stats())["request_pages"]),
        ("moemesh_kv_cached_pages", "KV pages held by the prefix cache", lambda: page_account(stats())["cached_pages"]),
        ("moemesh_kv_live_requests", "Requests holding KV pages on this worker",
         lambda: page_account(stats())["live_requests"]),
        ("moemesh_kv_leaked_pages", "Request pages while no request is alive (should be 0)",
         lambda: leaked_pages(page_account(stats()))),
    ):  # fmt: skip
        Gauge(name, doc, registry=registry).set_function(fn)
