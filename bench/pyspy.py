"""py-spy around a benchmark phase: sample a service process while the phase runs, then fold the samples
into the frames that took the most of each thread's time (where a served number falls short, where its
time went). py-spy is optional (`pip install py-spy`; `scripts/gpu_wheels.sh mesh` bundles it): without it,
or without ptrace rights on the process, `Profile.start` says why and the phase runs unprofiled.

    prof = Profile.start(pid, Path("decode-0.pyspy.txt")); ...phase...; summary = prof.stop()
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LINE = re.compile(r":\d+\)$")  # a frame's line number: frames fold per function


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """py-spy's raw (collapsed) output -> per thread: samples, the functions on the most stacks (`top`:
    inclusive share of that thread's samples, each function counted once per stack), and the functions
    the samples were in (`self`: exclusive share, the innermost frame)."""
    per_thread: dict[str, Counter[str]] = {}
    leaves: dict[str, Counter[str]] = {}
    samples: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        n = int(count)
        samples[thread] += n
        seen = {_LINE.sub(")", f) for f in frames}
        funcs = per_thread.setdefault(thread, Counter())
        for f in seen:
            funcs[f] += n
        if frames:
            leaves.setdefault(thread, Counter())[_LINE.sub(")", frames[-1])] += n
    return {
        thread: {
            "samples": samples[thread],
            "top": [(f, round(c / samples[thread], 4)) for f, c in funcs.most_common(top)],
            "self": [(f, round(c / samples[thread], 4)) for f, c in leaves.get(thread, Counter()).most_common(top)],
        }
        for thread, funcs in per_thread.items()
    }


def executable() -> str | None:
    """py-spy on PATH, else beside this Python (a venv's, when its bin/ is not on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


@dataclass
class Profile:
    proc: subprocess.Popen | None
    out: Path
    error: str = ""

    @classmethod
    def start(cls, pid: int, out: Path, rate: int = 200, max_s: int = 600) -> Profile:
        exe = executable()
        if exe is None:
            return cls(None, out, "py-spy is not installed")
        argv = [exe, "record", "-p", str(pid), "-r", str(rate), "-d", str(max_s), "-f", "raw", "-o", str(out)]
        argv += ["--threads", "--nonblocking"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return cls(proc, out)

    def stop(self, top: int = 25, timeout: float = 30.0) -> dict[str, Any]:
        """SIGINT (py-spy then writes what it sampled), and the summary; {"error": ...} when it could not."""
        if self.proc is None:
            return {"error": self.error}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.out.is_file():
            return {"error": f"py-spy wrote nothing (rc {self.proc.returncode}): {(err or '')[-500:]}"}
        return {"file": str(self.out), "threads": summarize(self.out.read_text(errors="replace"), top)}
