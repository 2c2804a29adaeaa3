"""Fixtures shared by every test folder."""

# Importing the kernel tests' conftest first puts Triton in interpreter mode on machines without CUDA
# before any test module (or torch._dynamo) imports triton: the mode is fixed at triton's first import,
# and other folders are collected before tests/libs/kernels.

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from libs.natsd import start_nats_server
from tests.libs.kernels.conftest import HAS_CUDA  # noqa: F401  (the import sets the interpreter up)
from tests.worker_exit import oom_kills, report, worker_returncode

_OOM_KILLS_AT_START = oom_kills()  # read where the run begins: this module is imported before any test runs
_CRASHES: list[str] = []  # the reports of workers that died, repeated in the run's summary


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A pytest-xdist worker that died mid-test: its exit status and the memory state (tests/worker_exit.py),
    printed at once and again at the end of the run (where a CI log's tail shows it)."""
    if error:
        _CRASHES.append(report(node.gateway.id, worker_returncode(node), _OOM_KILLS_AT_START))
        print(_CRASHES[-1], file=sys.stderr, flush=True)


def pytest_terminal_summary(terminalreporter) -> None:
    if _CRASHES:
        terminalreporter.section("test workers that died")
        for text in _CRASHES:
            terminalreporter.write_line(text)


@pytest.fixture(scope="module")
def private_nats_url() -> Iterator[str]:
    """A nats-server of the test module's own (no JetStream), for tests on the mesh's fixed subjects
    (heartbeats, the one broker subject): they see no other module's traffic, nor a service an earlier
    module left behind."""
    server = start_nats_server(jetstream=False)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[str]:
    """URL of one real nats-server (JetStream on, temporary store) shared by the whole session.

    Tests that share it must use unique subjects / bucket names (e.g. with a uuid) so they cannot
    see each other's traffic.
    """
    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _own_tuning_cache(monkeypatch, tmp_path):
    """FP8 GEMM tuning choices made in a test (on a GPU, often with a faked clock) go to a folder of the
    test's own, never the user's cache, where a later benchmark on the same machine would read them; and no
    test sees another's choices read into memory."""
    import sys

    monkeypatch.setenv("MOEMESH_TUNING_DIR", str(tmp_path / "tuning-cache"))
    tuning = sys.modules.get("libs.kernels.gemm_tuning")
    if tuning is not None:
        monkeypatch.setattr(tuning, "_STORED", None)
