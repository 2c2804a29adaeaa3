"""What the controller of `make test` prints when a pytest-xdist worker dies mid-test: xdist says only "node
down: Not properly terminated", which fits a segfault (faulthandler would have printed a stack), the kernel's
OOM killer, a stray signal and a native library calling exit() alike. This names the worker's exit status and
the machine's memory state at that moment, so a crash seen once in CI says which it was."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

# the kernel's count of OOM kills since boot (a global OOM is counted here, not in the memory cgroup's own
# files), then the memory cgroup's (v2, v1) for a container's limit: the first readable one answers
OOM_EVENTS = (
    Path("/proc/vmstat"),
    Path("/sys/fs/cgroup/memory.events"),
    Path("/sys/fs/cgroup/memory/memory.oom_control"),
)


def describe_status(returncode: int | None) -> str:
    """A Popen returncode in words: "killed by SIGKILL (9)", "exited with code 1", "still running"."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} ({-returncode})"
    return f"exited with code {returncode}"


def oom_kills(paths: tuple[Path, ...] = OOM_EVENTS) -> int | None:
    """The `oom_kill` count of the first readable file of `paths` that has one; None where none has."""
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def mem_available_mib(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def largest_processes(n: int = 5) -> list[str]:
    """`ps`'s n largest processes by resident memory (MiB, pid, command), [] without ps."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "rss=,pid=,args=", "--sort=-rss"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = []
    for line in out.splitlines()[:n]:
        rss, pid, args = (line.split(None, 2) + ["", ""])[:3]
        rows.append(f"{int(rss) // 1024:>6} MiB  pid {pid}  {args[:100]}")
    return rows


def report(worker: str, returncode: int | None, oom_kills_at_start: int | None) -> str:
    """The lines printed for a worker that went down with an error; oom_kills_at_start: `oom_kills()` when
    the run began (the kills since are the run's)."""
    lines = [f"[{worker}] worker process {describe_status(returncode)}"]
    avail, kills = mem_available_mib(), oom_kills()
    since = "unknown" if kills is None or oom_kills_at_start is None else kills - oom_kills_at_start
    lines.append(
        f"[{worker}] memory now: {'?' if avail is None else avail} MiB available; OOM kills since the run "
        f"began: {since}"
    )
    lines += [f"[{worker}]   {row}" for row in largest_processes()]
    return "\n".join(lines)


def worker_returncode(node: object, timeout_s: float = 10.0) -> int | None:
    """The exit status of an xdist worker (execnet's popen gateway keeps its Popen); None if unknown."""
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    if popen is None:
        return None
    try:
        return popen.wait(timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
