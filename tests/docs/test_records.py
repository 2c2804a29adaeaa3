"""Every benchmark record the README and docs/ quote exists, and bench/results stays small.

Records back the numbers the documents quote; older ones live in git history
(`git log --all -- bench/results/NAME`), which is why bench/NOTES-*.md (history) are not checked here.
"""

from __future__ import annotations

import glob
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MAX_RECORDS = 60
# a quoted path runs until whitespace, a quote, a closing bracket or a table bar
QUOTED = re.compile(r"bench/results/[^\s`'\"()\[\]<>|]*")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def quoted_paths(text: str) -> list[str]:
    """The bench/results paths in `text`, trailing punctuation dropped; the folder itself is not a quote."""
    paths = (m.group(0).rstrip(".,;:") for m in QUOTED.finditer(text))
    return [p for p in paths if p.rstrip("/") != "bench/results"]


def expand(path: str) -> list[str]:
    """`a{b,c}d` -> [abd, acd] (one level per brace pair, any number of pairs)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return [
        "".join(f + c for f, c in itertools.zip_longest(fixed, combo, fillvalue=""))
        for combo in itertools.product(*choices)
    ]


def missing(path: str) -> list[str]:
    """The expansions of a quoted path that match nothing on disk (a `*` must match at least one file)."""
    return [p for p in expand(path) if not glob.glob(str(ROOT / p))]


def test_the_extractor_reads_what_the_documents_write() -> None:
    text = (
        "see `bench/results/a.json`, (bench/results/b-{x,y}.json); | bench/results/c/ | bench/results/ folder"
    )
    assert quoted_paths(text) == ["bench/results/a.json", "bench/results/b-{x,y}.json", "bench/results/c/"]
    assert expand("bench/results/b-{x,y}-{1,2}.json") == [
        "bench/results/b-x-1.json",
        "bench/results/b-x-2.json",
        "bench/results/b-y-1.json",
        "bench/results/b-y-2.json",
    ]
    assert missing("bench/results/no-such-record-20000101.json") == [
        "bench/results/no-such-record-20000101.json"
    ]


def test_every_quoted_record_exists() -> None:
    quoted = {
        (doc.relative_to(ROOT).as_posix(), p) for doc in documents() for p in quoted_paths(doc.read_text())
    }
    assert len({p for _, p in quoted}) >= 10, (
        "the documents quote fewer records than expected: is the pattern stale?"
    )
    dangling = sorted((doc, p, m) for doc, p in quoted for m in missing(p))
    assert not dangling, "quoted but not in bench/results (renamed or removed?):\n" + "\n".join(
        f"{doc}: {p}" + (f" ({m})" if m != p else "") for doc, p, m in dangling
    )


def test_bench_results_holds_at_most_60_files() -> None:
    files = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())
    assert files, "bench/results is empty"
    assert len(files) <= MAX_RECORDS, (
        f"bench/results holds {len(files)} files (at most {MAX_RECORDS}): keep the records the README and docs/ "
        f"quote, `git rm` the rest (git history keeps them)"
    )
