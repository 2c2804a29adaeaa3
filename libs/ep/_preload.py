"""Imported once by the forkserver that forks the EP rank processes (group.py), never anywhere else: it
loads what every rank needs (torch, the engine, libs.ep.rank) once, and makes the forkserver ignore
SIGINT/SIGTERM so it outlives the worker's drain."""

# A rank then starts without re-importing torch (under Triton's interpreter, patched as the tests' own). The
# supervisor signals a worker's whole process group on shutdown; the forkserver still exits when its pipe
# from the worker closes, and the ranks (which inherit the ignored signals) when stopped or orphaned.

import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

if os.environ.get("TRITON_INTERPRET") == "1":  # tests on CPU: the ranks' kernels as the test process runs them
    from libs.kernels.interpreter import patch_interpreter

    patch_interpreter()

import libs.ep.rank  # noqa: E402, F401
