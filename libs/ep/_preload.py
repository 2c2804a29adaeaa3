"""Imported once by the forkserver that forks the EP rank processes (group.py), never anywhere else.

It loads what every rank needs (torch, the engine, libs.ep.rank) once, so a rank starts in milliseconds
instead of re-importing torch (under Triton's interpreter, patched as the tests' own), and it makes the forkserver ignore SIGINT/SIGTERM: the supervisor signals a
worker's whole process group on shutdown, and the ranks' parent (this forkserver) must outlive the worker's
drain. The forkserver still exits when the worker does (its pipe from the worker closes); the ranks, which
inherit the ignored signals, exit when the worker stops them or their pipe closes.
"""

import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

if os.environ.get("TRITON_INTERPRET") == "1":  # tests on CPU: the ranks' kernels as the test process runs them
    from libs.kernels.interpreter import patch_interpreter

    patch_interpreter()

import libs.ep.rank  # noqa: E402, F401
