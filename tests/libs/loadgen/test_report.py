"""Result files and the console table."""

from __future__ import annotations

import json
from pathlib import Path

from libs.loadgen.report import format_summary, write_json
from libs.loadgen.stats import RequestRecord, summarize


def test_json_keeps_number_lists_on_one_line_and_round_trips(tmp_path: Path) -> None:
    rec = RequestRecord(index=0, start=0.1234567891, end=1.0, chunk_times=[0.5, 0.75, 1.0], chunk_tokens=[1, 2, 1],
                        prompt_tokens=4, completion_tokens=4, ok=True)  # fmt: skip
    data = {"requests": [rec.to_json()], "trace": [[0.0, 3], [0.5, 4]], "labels": ["a", "b"]}
    text = write_json(tmp_path / "r.json", data).read_text()
    assert '"chunk_times": [0.5,0.75,1.0]' in text and "[0.0,3]" in text
    loaded = json.loads(text)
    assert loaded["requests"][0]["start"] == 0.123457  # rounded to the microsecond
    assert loaded["trace"] == data["trace"] and loaded["labels"] == ["a", "b"]


def test_console_table_shows_the_headline_numbers() -> None:
    rec = RequestRecord(index=0, start=0.0, end=2.0, chunk_times=[0.25, 2.0], chunk_tokens=[1, 1],
                        prompt_tokens=8, completion_tokens=2, ok=True)  # fmt: skip
    table = format_summary(summarize([rec], 4.0))
    assert "Successful requests:" in table and "Median TTFT (ms):" in table
    assert "250.00" in table  # TTFT in ms
    assert "0.50" in table  # output throughput: 2 tokens in 4 s
