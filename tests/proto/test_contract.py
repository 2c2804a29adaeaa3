"""Every bus message round-trips through msgpack, unions dispatch on the tag, and versions are checked."""

from __future__ import annotations

import inspect
import typing

import msgspec
import pytest

import proto
from proto import messages as m
from proto import subjects

SAMPLING = m.Sampling(
    max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, seed=7, stop=["\n"], logprobs=True, top_logprobs=2
)
GEOM = m.KvGeometry(
    num_layers=3,
    num_pages=64,
    page_size=16,
    page_bytes=4096,
    layer_stride=262144,
    base_addr=1 << 40,
    dtype="float32",
)
HANDLE = m.KvHandle(
    handle_id="h1",
    request_id="r1",
    decode_worker="d0",
    session_id="127.0.0.1:1234",
    page_ids=[3, 4, 9],
    num_tokens=40,
    lease_expires_ms=123,
)
LP = m.TokenLogprob(token_id=5, logprob=-0.25, top=[m.TopLogprob(5, -0.25), m.TopLogprob(6, -1.5)])

EXAMPLES: list[msgspec.Struct] = [
    m.Submit(
        request_id="r1",
        model="tiny",
        prompt_ids=[1, 2, 3],
        sampling=SAMPLING,
        stream_subject="mesh.stream.g0",
        arrival_ms=5,
    ),
    m.SubmitReply(request_id="r1", ok=False, code=429, message="queue full"),
    m.Cancel(request_id="r1", reason="client disconnected"),
    m.WorkerHeartbeat(
        worker_id="d0",
        role=m.Role.DECODE,
        model="tiny",
        running=2,
        waiting=0,
        free_pages=10,
        total_pages=64,
        page_size=16,
        max_context=4096,
        interval_ms=500,
        sent_ms=9,
    ),
    m.WorkerGone(worker_id="d0", role=m.Role.DECODE),
    m.ReserveKv(request_id="r1", num_tokens=40, lease_ms=30000),
    m.ReserveKvReply(request_id="r1", ok=True, handle=HANDLE),
    m.KvReady(
        request_id="r1",
        handle_id="h1",
        prompt_ids=[1, 2],
        sampling=SAMPLING,
        stream_subject="s",
        first_token=LP,
        cached_tokens=16,
        block_hashes=[2**64 - 1, 0, 12345],  # u64 block hashes
    ),
    m.DecodeDirect(request_id="r1", prompt_ids=[1], sampling=m.Sampling(), stream_subject="s"),
    m.PrefillFailed(request_id="r1", handle_id="h1", message="boom"),
    m.PrefillTask(request_id="r1", prompt_ids=[1, 2], sampling=SAMPLING, stream_subject="s", handle=HANDLE),
    m.TokenBatch(
        deltas=[
            m.TokenDelta("r1", [5], [LP]),
            m.TokenDelta("r2", [7, 8], finish=m.FinishReason.LENGTH, prompt_tokens=3, completion_tokens=4),
        ]
    ),
    m.RequestError(request_id="r1", code=500, message="worker died"),
    m.RegisterWorker(worker_id="d0", role=m.Role.DECODE, session_id="127.0.0.1:1", geometry=GEOM),
    m.LookupWorker(worker_id="d0"),
    m.CreateHandle(handle=HANDLE),
    m.HandleWritten(handle_id="h1"),
    m.HandleConsumed(handle_id="h1"),
    m.ReleaseHandle(handle_id="h1", reason="done"),
    m.LookupHandle(handle_id="h1"),
    m.ListHandles(decode_worker="d0"),
    m.BrokerReply(
        ok=True,
        worker=m.WorkerRecord(worker_id="d0", role=m.Role.DECODE, session_id="x", geometry=GEOM),
        handles=[m.HandleRecord(handle=HANDLE, state=m.HandleState.WRITTEN, updated_ms=1)],
    ),
    m.HandleExpired(handle_id="h1", request_id="r1"),
    m.GetStats(),
    m.SetSlowdown(forward_sleep_ms=20.0),
    m.AdminReply(
        ok=True,
        stats=m.WorkerStats(
            worker_id="d0",
            role=m.Role.DECODE,
            running=1,
            waiting=0,
            free_pages=3,
            total_pages=4,
            reserved_handles=0,
        ),
    ),
    m.Rejected(code=400, message="garbage"),
    m.BlocksStored(worker_id="p0", epoch="e1", seq=1, hashes=[2**64 - 1, 0, 12345]),
    m.BlocksRemoved(worker_id="p0", epoch="e1", seq=2, hashes=[12345]),
    m.KvSnapshotRequest(worker_id="p0"),
    m.KvSnapshot(worker_id="p0", epoch="e1", seq=2, hashes=[2**64 - 1, 0]),
    m.PrefixQuery(page_size=16, hashes=[1, 2, 3]),
    m.PrefixReply(cached_tokens={"p0": 32, "d0": 16}),
    m.SchedulerHeartbeat(scheduler_id="s0", interval_ms=250, sent_ms=9, queued=3),
    m.LauncherStatus(
        launcher_id="launcher-1",
        services=[
            m.ServiceState(name="decode-0", status=m.ServiceStatus.UP, restarts=1, last_exit_code=-9),
            m.ServiceState(name="prefill-0", status=m.ServiceStatus.GIVEN_UP, restarts=5, last_exit_code=2),
        ],
        interval_ms=1000,
        sent_ms=9,
    ),
    m.TokenBatch(deltas=[m.TokenDelta("r1", [5], offset=3)], worker_id="d0"),
    m.RequestError(request_id="r1", code=503, message="prefill worker p0 died", worker_id="p0"),
    m.ReserveKv(request_id="r2", num_tokens=3, lease_ms=100, prompt_ids=[5, 6, 7]),
    m.PrefillTask(
        request_id="r2",
        prompt_ids=[5, 6, 7],
        sampling=SAMPLING,
        stream_subject="s",
        handle=msgspec.structs.replace(HANDLE, cached_tokens=16),
    ),  # fmt: skip
    m.PrefillStart(request_id="r3", prompt_ids=[5, 6], sampling=SAMPLING, stream_subject="s"),
    m.PrefillAbandon(request_id="r3"),
]


def _top_level_messages() -> set[type]:
    return {
        obj
        for obj in vars(m).values()
        if inspect.isclass(obj) and issubclass(obj, m.Kind) and obj is not m.Kind
        and not obj.__name__.startswith("_")  # field groups that keep array layouts append-only
    }


def test_every_message_has_an_example() -> None:
    assert {type(x) for x in EXAMPLES} == _top_level_messages()


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg: msgspec.Struct) -> None:
    assert proto.decoder(type(msg)).decode(proto.encode(msg)) == msg


@pytest.mark.parametrize(
    "union",
    [m.DecodeInbox, m.PrefillInbox, m.StreamMessage, m.BrokerRequest, m.Heartbeat, m.AdminRequest, m.KvEvent],
)
def test_unions_dispatch_on_tag(union: object) -> None:
    members = typing.get_args(union) or (union,)
    dec = proto.decoder(union)
    for msg in EXAMPLES:
        if type(msg) in members:
            out = dec.decode(proto.encode(msg))
            assert type(out) is type(msg) and out == msg


def test_wrong_message_on_subject_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        proto.decoder(m.DecodeInbox).decode(proto.encode(m.Cancel(request_id="r")))


def test_garbage_is_refused() -> None:
    with pytest.raises(msgspec.DecodeError):
        proto.decoder(m.StreamMessage).decode(b"\xc1not msgpack")


def test_newer_schema_version_is_refused_clearly() -> None:
    data = proto.encode(m.Cancel(request_id="r", v=m.SCHEMA_VERSION + 1))
    with pytest.raises(proto.SchemaVersionError, match="schema version"):
        proto.decoder(m.Cancel).decode(data)


def test_token_batch_is_compact() -> None:
    # the hot message: array-like, defaults omitted -> a one-token delta stays small
    data = proto.encode(m.TokenBatch(deltas=[m.TokenDelta("req-0123456789", [42])]))
    assert len(data) < 40


def test_subject_tokens_are_checked() -> None:
    assert subjects.decode_inbox(subjects.check_token("d0")) == "mesh.decode.d0"
    for bad in ["", "a.b", "a b", "*", ">"]:
        with pytest.raises(ValueError):
            subjects.check_token(bad)


# Sampling's fields at each schema version. Sampling is map-encoded, so a reader that lacks a field skips it
# silently; every field that changes the output therefore comes with a SCHEMA_VERSION bump (older readers
# refuse the message instead, libs/bus). Adding a field here without bumping the version fails below.
SAMPLING_FIELDS = {
    1: {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop",
        "ignore_eos", "logprobs", "top_logprobs"},
    2: {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "guided"},
    3: set(),  # Guided.start_after (GUIDED_FIELDS)
}  # fmt: skip
GUIDED_FIELDS = {2: {"kind", "value"}, 3: {"start_after"}}


def test_sampling_fields_are_versioned() -> None:
    known = set().union(*(f for v, f in SAMPLING_FIELDS.items() if v <= m.SCHEMA_VERSION))
    assert set(m.Sampling.__struct_fields__) == known
    assert max(SAMPLING_FIELDS) == m.SCHEMA_VERSION
    guided = set().union(*(f for v, f in GUIDED_FIELDS.items() if v <= m.SCHEMA_VERSION))
    assert set(m.Guided.__struct_fields__) == guided and max(GUIDED_FIELDS) <= m.SCHEMA_VERSION


def test_older_version_is_read_with_neutral_defaults() -> None:
    """A version-1 sender (no penalties or grammar on the wire) is still served."""

    class OldSampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
        max_tokens: int = 16

    class OldSubmit(m.Kind, frozen=True, tag="Submit"):
        request_id: str
        model: str
        prompt_ids: list[int]
        sampling: OldSampling
        stream_subject: str

    old = OldSubmit(request_id="r", model="m", prompt_ids=[1], sampling=OldSampling(max_tokens=3), stream_subject="s",
                    v=1)  # fmt: skip
    new = proto.decoder(m.Submit).decode(proto.encode(old))
    assert new.v == 1 and new.sampling == m.Sampling(max_tokens=3)
