"""Fault injection on a running mesh: streaming load, kills at a chosen moment, outcome tables, the leak
check. Used by tests/e2e/test_chaos.py and bench/chaos.py."""

from libs.chaos.fault_table import FaultResult, summarize
from libs.chaos.load import Outcome, stream_completion, stream_many
from libs.chaos.workers import metric_total, request_pages, wait_for_no_leaks

__all__ = [
    "FaultResult",
    "Outcome",
    "metric_total",
    "request_pages",
    "stream_completion",
    "stream_many",
    "summarize",
    "wait_for_no_leaks",
]
