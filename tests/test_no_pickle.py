"""No pickle anywhere in the tree, tests included, so no byte stream from the network or disk can run code:
bus messages are msgspec/msgpack, weights are safetensors. Each rule has a name; a file may be allowed a rule
only with a reason."""

# Pickle also hides in multiprocessing: Pipe/Connection send/recv, multiprocessing (and torch.multiprocessing)
# queues and managers, and the arguments of a spawned process (spawn/forkserver pickle them to the child);
# and in np.load(allow_pickle=True), pandas' pickles and torch.load without weights_only=True.

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("proto", "libs", "services", "bench", "scripts", "deploy", "tests")
_MP = r"(?:\bmp|\bctx|\bmultiprocessing|\btorch\.multiprocessing)"
RULES: dict[str, re.Pattern[str]] = {
    "pickle-import": re.compile(
        r"^\s*(import|from)\s+(c?pickle|_pickle|cloudpickle|dill|joblib|shelve|marshal|copyreg)\b", re.M
    ),
    "pickle-call": re.compile(r"\b(c?pickle|cloudpickle|dill|marshal)\.(loads?|dumps?|Unpickler|Pickler)\b"),
    "pandas-pickle": re.compile(r"\b(read|to)_pickle\("),
    "torch-load": re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"),
    "numpy-pickle": re.compile(r"\ballow_pickle\s*=\s*(?!False\b)"),
    # multiprocessing Pipe/Connection: send() pickles, recv() unpickles (by the names connections go by)
    "pipe": re.compile(r"\bPipe\(|\bmultiprocessing\.connection\b|\b_?conns?\b(\[[^\]]*\])?\.(send|recv)\("),
    # queues and managers move objects between processes by pickling them (queue.SimpleQueue: threads only)
    "mp-queue": re.compile(
        rf"{_MP}\.(Simple|Joinable)?Queue\(|(?<!queue\.)\b(SimpleQueue|JoinableQueue)\(|{_MP}\.Manager\(|\bBaseManager\b"
    ),
    # a spawned process's target and arguments are pickled to the child (spawn, forkserver)
    "spawn-args": re.compile(
        rf"{_MP}\.(spawn|start_processes)\(|(?<![\w.])(spawn|start_processes)\(|\.Process\(|(?<![\w.])Process\("
    ),
    "mp-import": re.compile(
        r"^\s*from\s+(torch\.)?multiprocessing(\.\w+)?\s+import\s+[^\n]*"
        r"\b(Queue|SimpleQueue|JoinableQueue|Pipe|Manager|Process|spawn|start_processes)\b",
        re.M,
    ),
}
# path -> {rule: why it is not a risk}. Only local IPC between a process and the children it spawned
# itself, never bytes from the network or from disk, may appear here.
ALLOWED: dict[str, dict[str, str]] = {
    "libs/ep/group.py": {
        "pipe": "multiprocessing Pipe to the EP rank processes this front spawned (own children only)",
        "spawn-args": "the rank's index, RankSpec and Pipe end go to the EP rank process it spawns itself",
    },
    "libs/ep/rank.py": {
        "pipe": "the EP rank process's end of that Pipe: it talks only to the front that spawned it"
    },
    "bench/decode_rank.py": {
        "spawn-args": "torch.multiprocessing.spawn of its own GPU ranks with its argparse args"
    },
    "bench/ep_dispatch.py": {
        "spawn-args": "torch.multiprocessing.spawn of its own GPU ranks with its argparse args"
    },
    "tests/libs/ep/test_rebalance.py": {
        "spawn-args": "torch.multiprocessing.spawn of its own two test ranks with a backend name and a store path"
    },
    "tests/libs/ep/test_two_batch_overlap_ep.py": {
        "spawn-args": "torch.multiprocessing.spawn of its own two gloo test ranks with a store path"
    },
}
SELF = Path(__file__).resolve()  # holds every forbidden form as a sample


def offenders(files: list[Path] | None = None) -> list[str]:
    if files is None:
        files = [p for top in SOURCES if (ROOT / top).is_dir() for p in sorted((ROOT / top).rglob("*.py"))]
    found = []
    for path in files:
        if path.resolve() == SELF:
            continue
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        text = path.read_text(errors="replace")
        for name, pat in RULES.items():
            if name in ALLOWED.get(rel, {}):
                continue
            for match in pat.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{rel}:{line}: [{name}] {match.group(0).strip()}")
    return found


def test_no_pickle_in_the_tree() -> None:
    assert offenders() == []


def test_the_scan_covers_the_tests() -> None:
    scanned = {p.resolve() for p in (ROOT / "tests").rglob("*.py")}
    assert Path(ROOT / "tests" / "e2e" / "test_mesh.py").resolve() in scanned and "tests" in SOURCES


def test_every_allowance_names_a_file_and_rule_that_exist() -> None:
    for rel, rules in ALLOWED.items():
        assert (ROOT / rel).is_file(), rel
        assert set(rules) <= set(RULES), rules
        assert all(why.strip() for why in rules.values())


FORBIDDEN_SAMPLES = {
    "pickle-import": ["import pickle", "from cloudpickle import dumps", "import copyreg"],
    "pickle-call": ["x = pickle.loads(b)"],
    "pandas-pickle": ["df.to_pickle(p)"],
    "torch-load": ["torch.load(f)", "torch.load(f, weights_only=False)"],
    "numpy-pickle": ["np.load(path, allow_pickle=True)", "numpy.load(f, allow_pickle=flag)"],
    "pipe": ["parent, child = ctx.Pipe()", "msg = conn.recv()", "self._conns[r].send(msg)"],
    "mp-queue": [
        "q = mp.Queue()",
        "q = ctx.SimpleQueue()",
        "q = SimpleQueue()",
        "torch.multiprocessing.Queue(4)",
        "m = mp.Manager()",
    ],
    "spawn-args": [
        "torch.multiprocessing.spawn(worker, args=(a,), nprocs=2)",
        "mp.spawn(fn, nprocs=2)",
        "start_processes(fn, args=(x,))",
        "p = ctx.Process(target=f, args=(x,))",
        "Process(target=f)",
    ],
    "mp-import": ["from torch.multiprocessing import Queue, spawn", "from multiprocessing import Process"],
}
ALLOWED_SAMPLES = [
    "torch.load(f, weights_only=True)",
    "np.load(path)",
    "np.load(path, allow_pickle=False)",
    "msgspec.msgpack.decode(data)  # no pickle here",
    "await websocket.send(data)",
    "q: asyncio.Queue[int] = asyncio.Queue()",
    "q = queue.Queue()",
    "q: queue.SimpleQueue[tuple] = queue.SimpleQueue()",
    "sp = ServiceProcess(spec, proc, log_path)",
    "proc = subprocess.Popen(args)",
    "import multiprocessing.util",
]


def test_each_rule_finds_what_it_forbids_and_nothing_else() -> None:
    assert set(FORBIDDEN_SAMPLES) == set(RULES)
    for name, samples in FORBIDDEN_SAMPLES.items():
        for s in samples:
            assert RULES[name].search(s), (name, s)
    for s in ALLOWED_SAMPLES:
        assert not [n for n, p in RULES.items() if p.search(s)], s


def test_a_file_allowed_one_rule_is_not_allowed_another(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("import pickle\nq = mp.Queue()\n")
    rel = bad.as_posix()
    assert offenders([bad]) == [f"{rel}:1: [pickle-import] import pickle", f"{rel}:2: [mp-queue] mp.Queue("]
    monkeypatch.setitem(ALLOWED, rel, {"pickle-import": "a sample"})
    assert offenders([bad]) == [f"{rel}:2: [mp-queue] mp.Queue("]
