"""The prefill worker's HandleWritten after a write: the broker refusing it because the decode side already
consumed (or consumed and released) the handle is the normal race of the hot path, not a warning; a refusal
on a handle past its lease is (those pages may be reused)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from proto import messages as m
from services.prefill_worker.service import PrefillWorker


def _record(state: m.HandleState) -> m.HandleRecord:
    handle = m.KvHandle(
        handle_id="h1", request_id="r1", decode_worker="decode-0", session_id="127.0.0.1:1", page_ids=[1],
        num_tokens=10, lease_expires_ms=1,
    )  # fmt: skip
    return m.HandleRecord(handle=handle, state=state, updated_ms=0)


class _Bus:
    def __init__(self, reply: m.BrokerReply) -> None:
        self.reply, self.asked = reply, []

    async def request(self, subject, msg, reply_type, timeout):  # noqa: ANN001 - Bus.request's shape
        self.asked.append(msg)
        return self.reply


@pytest.mark.parametrize(
    ("reply", "warned"),
    [
        (m.BrokerReply(ok=True, handle=_record(m.HandleState.WRITTEN)), False),
        (
            m.BrokerReply(ok=False, message="handle h1 is consumed", handle=_record(m.HandleState.CONSUMED)),
            False,
        ),
        (m.BrokerReply(ok=False, message="unknown handle 'h1'"), False),  # consumed, then released
        (
            m.BrokerReply(
                ok=False, message="handle h1: lease expired", handle=_record(m.HandleState.EXPIRED)
            ),
            True,
        ),
        (
            m.BrokerReply(
                ok=False, message="handle h1: lease expired", handle=_record(m.HandleState.RESERVED)
            ),
            True,
        ),
    ],
)
async def test_only_a_refusal_that_puts_the_write_in_question_warns(reply, warned, caplog):
    worker = SimpleNamespace(bus=_Bus(reply), settings=SimpleNamespace(broker_timeout_s=1.0))
    with caplog.at_level(logging.DEBUG, logger="moemesh.prefill"):
        await PrefillWorker._mark_written(worker, "h1")  # type: ignore[arg-type]
    assert worker.bus.asked == [m.HandleWritten(handle_id="h1")]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert bool(warnings) == warned, [r.getMessage() for r in caplog.records]
