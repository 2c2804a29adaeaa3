"""Text and JSON output of benchmark results (bench_serving's console table, files on disk)."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

_LINE = "=" * 60


def _row(name: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name:<44}{text:>16}"


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    rows = [
        _LINE,
        f"{title:^60}",
        _LINE,
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
        _row("Benchmark duration (s):", summary["duration_s"]),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Total generated tokens:", summary["total_output_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
        _row("Input token throughput (tok/s):", summary["input_throughput"]),
        _row("Output token throughput (tok/s):", summary["output_throughput"]),
        _row("Total token throughput (tok/s):", summary["total_token_throughput"]),
        _row("Concurrency:", summary["concurrency"]),
    ]
    for key, name in (("e2e_ms", "End-to-End Latency"), ("ttft_ms", "Time to First Token"),
                      ("tpot_ms", "Time per Output Token (excl. 1st token)"), ("itl_ms", "Inter-Token Latency")):  # fmt: skip
        d = summary[key]
        rows.append(f"{name:-^60}")
        rows += [_row(f"{stat.capitalize()} {key[:-3].upper()} (ms):", float(d[stat]))
                 for stat in ("mean", "median", "p90", "p99")]  # fmt: skip
    rows.append(_LINE)
    return "\n".join(rows)


_NUMBER_LIST = re.compile(r"\[\s+([-+\d.eE,\s]+?)\s+\]")


def dumps(data: Any) -> str:
    """Indented JSON with lists of numbers (chunk times, token counts) kept on one line."""
    text = json.dumps(data, indent=1)
    return _NUMBER_LIST.sub(lambda m: "[" + re.sub(r"\s+", "", m.group(1)) + "]", text)


def write_json(path: str | Path, data: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dumps(data) + "\n", encoding="utf-8")
    return p


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """The command line (default: this `moemesh` invocation's) and the client machine, for a results file to
    say how it was made."""
    return {
        "command": shlex.join(command if command is not None else ["moemesh", *sys.argv[1:]]),
        "environment": {
            "cpus": os.cpu_count(),
            "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
