"""No pickle anywhere in the source tree: bus messages are msgspec/msgpack, weights are safetensors, and
nothing that deserializes arbitrary objects (pickle, its relatives, torch.load without weights_only)
is allowed, so no byte stream from the network or disk can run code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("proto", "libs", "services", "bench", "scripts", "deploy")
FORBIDDEN = [
    re.compile(r"^\s*(import|from)\s+(c?pickle|_pickle|cloudpickle|dill|joblib|shelve|marshal)\b", re.M),
    re.compile(r"\b(c?pickle|cloudpickle|dill|marshal)\.(loads?|dumps?|Unpickler|Pickler)\b"),
    re.compile(r"\b(read|to)_pickle\("),
    re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"),
    # multiprocessing Pipe/Connection: send() pickles, recv() unpickles (by the names connections go by)
    re.compile(r"\bPipe\(|\bmultiprocessing\.connection\b|\b_?conns?\b(\[[^\]]*\])?\.(send|recv)\("),
]
# path -> why it is not a risk. Only local IPC between a process and the children it spawned itself,
# never bytes from the network, may appear here.
ALLOWED: dict[str, str] = {
    "libs/ep/group.py": "multiprocessing Pipe to the EP rank processes this front spawned (own children only)",
    "libs/ep/rank.py": "the EP rank process's end of that Pipe: it only talks to the front that spawned it",
}


def offenders() -> list[str]:
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            text = path.read_text(errors="replace")
            for pat in FORBIDDEN:
                for match in pat.finditer(text):
                    line = text.count("\n", 0, match.start()) + 1
                    found.append(f"{rel}:{line}: {match.group(0).strip()}")
    return found


def test_no_pickle_in_the_source_tree() -> None:
    assert offenders() == []


def test_the_check_finds_what_it_forbids(tmp_path: Path) -> None:
    samples = [
        "import pickle",
        "from cloudpickle import dumps",
        "x = pickle.loads(b)",
        "torch.load(f)",
        "df.to_pickle(p)",
        "parent, child = ctx.Pipe()",
        "msg = conn.recv()",
        "self._conns[r].send(msg)",
    ]
    for s in samples:
        assert any(p.search(s) for p in FORBIDDEN), s
    assert not any(p.search("torch.load(f, weights_only=True)") for p in FORBIDDEN)
    assert not any(p.search("msgspec.msgpack.decode(data)  # no pickle here") for p in FORBIDDEN)
    assert not any(p.search("await websocket.send(data)") for p in FORBIDDEN)
