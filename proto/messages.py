"""Bus messages of the mesh: msgspec Structs (frozen, tagged), msgpack on the wire, one union per subject
(proto.subjects). Every top-level message carries `v` (SCHEMA_VERSION); a receiver refuses a newer major
version rather than misread it. The life of a request through these messages: docs/architecture.md."""

# Life of a request: gateway --Submit--> scheduler --ReserveKv--> decode worker (--CreateHandle--> broker);
# scheduler --PrefillTask--> prefill worker --Mooncake write--> decode worker's pages; prefill --KvReady-->
# decode --TokenBatch--> gateway. Short prompts skip the prefill worker: scheduler --DecodeDirect--> decode.

from __future__ import annotations

import enum

import msgspec

# 2: Sampling has penalties, logit_bias, min_tokens and guided (structured output). A reader of 1 would
# drop them without a word (map-encoded fields it does not know are skipped), so it must refuse instead.
# Also 2: per-rank KV pools (KvRankPool, KvHandle.decode_rank).
# 3: Guided.start_after (the constraint starts after the reasoning ends): a reader of 2 would constrain the
# reasoning too.
SCHEMA_VERSION = 3


class Kind(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Base of every top-level message: tagged with the class name, versioned."""

    v: int = SCHEMA_VERSION


# ---------------------------------------------------------------------------------------------
# shared parts
# ---------------------------------------------------------------------------------------------


class Sampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling parameters, validated at the gateway (and again by the engine)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    guided: Guided | None = None


class Guided(msgspec.Struct, frozen=True):
    """Structured output: `kind` json | json_object | regex | choice | grammar; `value` the JSON schema,
    regex, JSON list of choices or EBNF grammar as text ("" for json_object). With `start_after`, the
    constraint applies only once the output has emitted those token ids (the end of the reasoning)."""

    kind: str
    value: str = ""
    start_after: list[int] = []


class TopLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprob of the sampled token and the top-n alternatives at that position."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = []


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # eos, stop token or stop string
    LENGTH = 2  # max_tokens or the context limit
    ABORT = 3  # cancelled
    ERROR = 4


class ErrorCode(enum.IntEnum):
    """HTTP-like codes so the gateway maps them 1:1 onto its responses."""

    BAD_REQUEST = 400
    NOT_FOUND = 404
    TOO_MANY_REQUESTS = 429
    INTERNAL = 500
    UNAVAILABLE = 503
    TIMEOUT = 504


class Role(enum.IntEnum):
    PREFILL = 1
    DECODE = 2


class KvGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """Byte layout of a worker's KV pool (libs.engine.kv_pool.KVPool): page p of layer l starts at
    base_addr + l * layer_stride + p * page_bytes. Two pools exchange pages only when num_layers,
    page_size and page_bytes agree."""

    num_layers: int
    num_pages: int
    page_size: int
    page_bytes: int
    layer_stride: int
    base_addr: int
    dtype: str


class KvRankPool(msgspec.Struct, frozen=True, kw_only=True):
    """One DP-attention rank's own KV pool in an EP worker whose ranks keep their pools apart (on GPUs, each
    on its rank's device): the rank's own Mooncake session and pool layout. Page ids for it are its own."""

    rank: int
    session_id: str
    geometry: KvGeometry


class KvHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's prompt KV must be written: pages reserved in a decode worker's pool. The decode worker
    holds the first `cached_tokens` tokens already (whole pages); the prefill side writes its pages from
    cached_tokens // page_size on into `page_ids`, in order."""

    handle_id: str
    request_id: str
    decode_worker: str
    session_id: str  # the decode worker's Mooncake session ("host:port")
    page_ids: list[int]
    num_tokens: int
    lease_expires_ms: int  # epoch ms; unclaimed after this, the pages are reclaimed
    cached_tokens: int = 0
    # the EP rank whose own pool holds page_ids (session_id is that rank's); -1: the worker's one pool
    decode_rank: int = -1


# ---------------------------------------------------------------------------------------------
# gateway <-> scheduler
# ---------------------------------------------------------------------------------------------


class Submit(Kind, frozen=True):
    """A tokenized, validated request from a gateway. Tokens stream to `stream_subject`."""

    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: Sampling
    stream_subject: str
    arrival_ms: int = 0
    # Workers not to place this request on: a migrating request names the worker it lost.
    avoid: list[str] = []


class SubmitReply(Kind, frozen=True):
    """Admitted (`ok`) or refused with an HTTP-like code and a message."""

    request_id: str
    ok: bool
    code: int = 200
    message: str = ""
    scheduler_id: str = ""  # the replica that holds the request until it is placed


class Cancel(Kind, frozen=True):
    """Drop this request wherever it is (client disconnect, deadline): free its pages."""

    request_id: str
    reason: str = ""


# ---------------------------------------------------------------------------------------------
# worker liveness and load
# ---------------------------------------------------------------------------------------------


class WorkerHeartbeat(Kind, frozen=True):
    """Periodic load report; a worker unheard for a few periods is considered dead."""

    worker_id: str
    role: Role
    model: str
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    page_size: int
    max_context: int
    interval_ms: int
    sent_ms: int
    draining: bool = False
    # prompt tokens queued or mid-prompt, not yet computed (prefill workers; 0 from senders that predate it)
    waiting_tokens: int = 0
    # requests its running batch holds at most (the engine's max_num_seqs, summed over an EP group's ranks;
    # 0 from senders that predate it): placements beyond the free slots wait in its line
    max_running: int = 0
    # placements accepted but in neither the batch nor the line yet (a decode worker: pages reserved for KV
    # on its way from a prefill worker, direct prompts queued for its next step; 0 from senders that
    # predate it): each takes a batch slot soon, so the scheduler counts them as load and in the line
    pending: int = 0


class WorkerGone(Kind, frozen=True):
    """Sent by a worker on graceful shutdown so schedulers stop placing on it at once."""

    worker_id: str
    role: Role


Heartbeat = WorkerHeartbeat | WorkerGone


class SchedulerHeartbeat(Kind, frozen=True):
    """A scheduler replica is alive (proto.subjects.SCHED_HEARTBEAT): a gateway whose request waits in
    that replica's queue migrates it once the replica falls silent."""

    scheduler_id: str
    interval_ms: int
    sent_ms: int
    queued: int = 0


class ServiceStatus(enum.IntEnum):
    """A supervised service's state in the embedded launcher (libs.launch.restart_policy.State)."""

    UP = 1
    RESTARTING = 2  # exited; started again after its backoff
    GIVEN_UP = 3  # exited too often within the restart window: left down
    STOPPED = 4  # the mesh is shutting down


class ServiceState(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # "decode-0", "kv-broker", "nats-server", ...
    status: ServiceStatus
    restarts: int  # restarts since the launcher started (0: the first incarnation)
    last_exit_code: int | None = None  # negative: killed by that signal


class LauncherStatus(Kind, frozen=True):
    """The embedded launcher's (`moemesh up`) view of the services it supervises, on
    proto.subjects.LAUNCHER_STATUS every `interval_ms` and on every change; gateways export it."""

    launcher_id: str
    services: list[ServiceState]
    interval_ms: int
    sent_ms: int


# ---------------------------------------------------------------------------------------------
# scheduler -> decode worker (inbox union), prefill -> decode
# ---------------------------------------------------------------------------------------------


class ReserveKv(Kind, frozen=True):
    """Request/reply: allocate pages for `num_tokens` prompt tokens and register a KV handle. With
    `prompt_ids` (len == num_tokens) the decode worker reuses the prompt's prefix from its own cache and
    reserves only the pages after it (the handle's `cached_tokens`)."""

    request_id: str
    num_tokens: int
    lease_ms: int
    prompt_ids: list[int] = []
    # Who fills the pages and who hears of failure: the decode worker tells `stream_subject` (a
    # retryable RequestError) when `prefill_worker` dies or the lease runs out before KvReady.
    stream_subject: str = ""
    prefill_worker: str = ""


class ReserveKvReply(Kind, frozen=True):
    request_id: str
    ok: bool
    handle: KvHandle | None = None
    code: int = 200
    message: str = ""


class KvReady(Kind, frozen=True):
    """Prefill finished and the pages are written: join the decode batch with this first token."""

    request_id: str
    handle_id: str
    prompt_ids: list[int]
    sampling: Sampling
    stream_subject: str
    first_token: TokenLogprob
    cached_tokens: int = 0
    prefill_worker: str = ""
    # the prefill worker already streamed first_token to the gateway (offset 0): not sent again
    first_token_streamed: bool = False
    # the block hashes of the prompt's whole pages (libs.prefix, as the prefill worker's cache named them):
    # the decode worker reuses them for its KV events when it caches the prompt (a reader without the field
    # hashes the prompt itself: no version bump)
    block_hashes: list[int] = []


class DecodeDirect(Kind, frozen=True):
    """Conditional disaggregation: the prompt is short (or cached), prefill it on the decode worker."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    stream_subject: str


class PrefillFailed(Kind, frozen=True):
    """The prefill side gave up: release the reservation; the scheduler/gateway hear via the stream.
    `wrote`: a write into the handle's pages had begun, so its bytes may still land (a stalled connection)."""

    request_id: str
    handle_id: str
    message: str
    wrote: bool = False


# ---------------------------------------------------------------------------------------------
# scheduler -> prefill worker
# ---------------------------------------------------------------------------------------------


class PrefillTask(Kind, frozen=True):
    """Run the prompt, write its KV into `handle`'s pages, then send KvReady to the decode worker."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    stream_subject: str
    handle: KvHandle


class PrefillStart(Kind, frozen=True):
    """Start the prompt now; its PrefillTask (with the KV handle) follows once the decode worker has
    reserved pages (the scheduler's overlap_prefill), so the reservation round trip overlaps the prefill.
    A PrefillAbandon, a Cancel, or no PrefillTask within the worker's early_prefill_ttl_s drops it."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    stream_subject: str


class PrefillAbandon(Kind, frozen=True):
    """The reservation behind a PrefillStart failed: drop the started prompt (the request may be placed
    again, here or elsewhere)."""

    request_id: str


PrefillInbox = PrefillTask | PrefillStart | PrefillAbandon


# ---------------------------------------------------------------------------------------------
# decode worker -> gateway (hot path)
# ---------------------------------------------------------------------------------------------


class TokenDelta(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request since its last delta. On the last one, finish != NONE and the
    usage counts are set."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = []
    finish: FinishReason = FinishReason.NONE
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # index of token_ids[0] in this request's output, so a receiver sees a lost or repeated delta;
    # -1: not given. An empty token_ids delta is a placement notice (see TokenBatch.worker_id).
    offset: int = -1


class _TokenBatchFields(Kind, frozen=True, array_like=True, omit_defaults=True, gc=False):
    deltas: list[TokenDelta]


class TokenBatch(_TokenBatchFields, frozen=True, kw_only=True):
    """All deltas for one gateway from one decode step; `worker_id` is the decode worker holding them (the
    gateway migrates them when it dies). Array layout [tag, deltas, v, worker_id]: fields are only appended
    after `v`, so readers of other versions decode each other's messages."""

    worker_id: str = ""


class _RequestErrorFields(Kind, frozen=True, array_like=True):
    request_id: str
    code: int
    message: str


class RequestError(_RequestErrorFields, frozen=True, kw_only=True):
    """The request ended with an error after admission; the gateway ends the stream with it, or, for a
    retryable code (503), migrates the request. `worker_id` names the worker at fault, so the retry
    avoids it."""

    worker_id: str = ""


StreamMessage = TokenBatch | RequestError


# ---------------------------------------------------------------------------------------------
# kv-broker (request/reply on proto.subjects.BROKER)
# ---------------------------------------------------------------------------------------------


class RegisterWorker(Kind, frozen=True):
    """A worker announces its Mooncake endpoint and KV pool layout (idempotent; sent on start)."""

    worker_id: str
    role: Role
    session_id: str
    geometry: KvGeometry
    ranks: list[KvRankPool] = []  # an EP worker's per-rank pools; empty: one pool (session_id, geometry)


class LookupWorker(Kind, frozen=True):
    worker_id: str


class CreateHandle(Kind, frozen=True):
    """Decode worker registers the pages it reserved for a request (state: reserved)."""

    handle: KvHandle


class HandleWritten(Kind, frozen=True):
    """Prefill worker finished writing the pages (state: written)."""

    handle_id: str


class HandleConsumed(Kind, frozen=True):
    """Decode worker took the pages into its batch (state: consumed; the lease no longer applies)."""

    handle_id: str


class ReleaseHandle(Kind, frozen=True):
    """The handle is dropped (cancel, failure, finished): forget it."""

    handle_id: str
    reason: str = ""


class LookupHandle(Kind, frozen=True):
    handle_id: str


class ListHandles(Kind, frozen=True):
    """Admin/test query: every live handle, optionally of one decode worker."""

    decode_worker: str = ""


BrokerRequest = (
    RegisterWorker
    | LookupWorker
    | CreateHandle
    | HandleWritten
    | HandleConsumed
    | ReleaseHandle
    | LookupHandle
    | ListHandles
)


class HandleState(enum.IntEnum):
    RESERVED = 1
    WRITTEN = 2
    CONSUMED = 3
    EXPIRED = 4


class HandleRecord(msgspec.Struct, frozen=True, kw_only=True):
    handle: KvHandle
    state: HandleState
    updated_ms: int


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    role: Role
    session_id: str
    geometry: KvGeometry
    ranks: list[KvRankPool] = []


class BrokerReply(Kind, frozen=True):
    """Answer to any BrokerRequest; `ok` False with a message on refusal (unknown handle, bad
    transition, geometry mismatch)."""

    ok: bool
    message: str = ""
    worker: WorkerRecord | None = None
    handle: HandleRecord | None = None
    handles: list[HandleRecord] = []


class HandleExpired(Kind, frozen=True):
    """Broker -> owning decode worker (on its inbox): the lease ran out, free the pages."""

    handle_id: str
    request_id: str


# ---------------------------------------------------------------------------------------------
# prefix-cache events: worker -> kv-broker (broadcast on proto.subjects.kv_events(worker)), snapshots
# (request/reply on proto.subjects.kv_snapshot(worker)), overlap queries (proto.subjects.BROKER_PREFIX)
# ---------------------------------------------------------------------------------------------


class KvTier(enum.IntEnum):
    """Where a cached KV block lives: a worker's device pool, its host-memory tier, or the shared store
    (Mooncake Store) every worker with the store tier reads."""

    DEVICE = 0
    HOST = 1
    STORE = 2


class BlocksStored(Kind, frozen=True):
    """Full KV pages that entered a worker's prefix cache, by block hash (libs.prefix: page i's stands for 0..i).
    `seq` counts one worker's events from 1 within its `epoch`; on a seq jump a receiver asks for a KvSnapshot.
    `tier`: DEVICE or HOST (held by this worker there now) or STORE (put in the shared store; maybe not held)."""

    worker_id: str
    epoch: str
    seq: int
    hashes: list[int]
    # a reader without the field takes every run as held on the device: host blocks then score as device
    # hits and store puts as this worker's blocks, both still hits where it sends them (no version bump)
    tier: KvTier = KvTier.DEVICE


class BlocksRemoved(Kind, frozen=True):
    """Blocks evicted from a worker's prefix cache (same numbering as BlocksStored)."""

    worker_id: str
    epoch: str
    seq: int
    hashes: list[int]


KvEvent = BlocksStored | BlocksRemoved


class KvSnapshotRequest(Kind, frozen=True):
    """kv-broker -> worker: every block hash the worker's prefix cache holds now (resync after a gap,
    a broker start, a worker not yet known)."""

    worker_id: str


class KvSnapshot(Kind, frozen=True):
    """Reply to KvSnapshotRequest: the complete set of cached block hashes as of event `seq` of `epoch`;
    it replaces what the receiver knew of the worker, and events after `seq` apply on top."""

    worker_id: str
    epoch: str
    seq: int
    hashes: list[int]
    # of `hashes` (every block held), those on the host tier; and whether the worker reads the shared
    # store (a reader without them sees every block on the device)
    host_hashes: list[int] = []
    store: bool = False


class PrefixQuery(Kind, frozen=True):
    """scheduler -> kv-broker: how much of a prompt each worker holds. `hashes` are the prompt's block
    hashes at `page_size` tokens per block, in order."""

    page_size: int
    hashes: list[int]


class PrefixReply(Kind, frozen=True):
    """Cached prompt tokens per worker (its run of leading blocks found, times page_size); workers
    holding none of the prompt are left out."""

    cached_tokens: dict[str, int] = {}
    # worker -> [device, host, store] tokens of the prompt's leading blocks by tier (cached_tokens counts
    # device + host); empty from a broker that predates tiers
    tiers: dict[str, list[int]] = {}


# ---------------------------------------------------------------------------------------------
# admin (request/reply on proto.subjects.admin(service, id))
# ---------------------------------------------------------------------------------------------


class GetStats(Kind, frozen=True):
    """Ask a service instance for its live counters."""


class SetSlowdown(Kind, frozen=True):
    """Decode worker: sleep this long before each forward (0 = off), so a full batch builds up."""

    forward_sleep_ms: float


class WorkerStats(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    role: Role
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    reserved_handles: int
    requests: list[str] = []
    forward_sleep_ms: float = 0.0
    # Leak check (libs.worker.page_accounting): pages held outside the prefix cache vs requests alive here.
    used_pages: int = 0
    cached_pages: int = 0
    request_pages: int = 0  # used_pages - cached_pages: reservations, running and pinned requests
    live_requests: int = 0


class AdminReply(Kind, frozen=True):
    ok: bool
    message: str = ""
    stats: WorkerStats | None = None


AdminRequest = GetStats | SetSlowdown


class Rejected(Kind, frozen=True):
    """Reply to a message that could not be decoded or handled (garbage, newer schema)."""

    code: int
    message: str


# A decode worker's inbox: the scheduler's and prefill side's messages, and the broker's expiry notices.
DecodeInbox = ReserveKv | KvReady | DecodeDirect | PrefillFailed | HandleExpired
