"""Placement policy of the scheduler, pure code (no I/O, no tensors): `schedule(workers, request, config,
prefix_hits)` over a heartbeat-built `WorkerTable` gives a `Plan` (direct, or a (prefill, decode) pair),
`Wait` (no capacity now) or `Refuse` (503: no live worker of a role; 400: it can never fit any worker)."""

# Times are monotonic seconds passed in by the caller (`now`), never read here, so tests drive the clock.
#
# Rules (why, where it is not obvious):
# - Liveness: a worker is dead once unheard for `dead_after_intervals` x its own heartbeat interval, or at
#   once on `WorkerGone`. Receive time is local, so clock skew between hosts does not matter.
# - Heartbeats are stale the moment the scheduler acts on them: every placement made since a worker's last
#   heartbeat counts as load on it (`inflight`) and its pages as used (`inflight_pages`) until the next
#   heartbeat, which reports the truth. A worker that refused or timed out a reservation is `suspended`
#   (treated as full) until its next heartbeat, so the retry goes elsewhere instead of hammering it.
# - Draining workers take no new work and do not count as live for admission.
# - Cache-aware score (`placement_score`): `prefix_weight` x (the worker's cached share of the prompt)
#   minus its load, so a full prefix hit is worth `prefix_weight` queued requests; the cache wins while
#   the imbalance it causes stays below that, and load wins past it. `prefix_weight` 0 is load-only
#   placement (the cache is not even a tie-breaker; the scheduler service then asks for no hits at all).
# - Decode choice: enough free pages for prompt + max_tokens (capped at its max_context), then best score
#   with load = running + pending + inflight, then most free pages, then most cached prefix, then worker id.
# - Conditional disaggregation: when the chosen decode worker's uncached prompt part (prompt length minus
#   its cached prefix) is at most `direct_prefill_threshold` tokens, prefill runs on the decode worker
#   itself; a threshold of 0 disables this.
# - Prefill choice: best score with load = queued work (running + waiting + inflight, in prompts), then
#   fewest prompt tokens still to compute (the heartbeat's waiting_tokens plus the uncached tokens placed
#   since), so of two workers with as many prompts the one with less prefill work takes the next, then most
#   cached prefix, then id.

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from libs.liveness import expires_at
from proto.messages import ErrorCode, Role, WorkerHeartbeat

# ---------------------------------------------------------------------------------------------
# configuration and inputs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyConfig:
    """`direct_prefill_threshold`: longest uncached prompt (tokens) prefilled on the decode worker itself (0
    disables). `dead_after_intervals`: heartbeat periods of silence after which a worker is dead.
    `prefix_weight`: what a full prefix-cache hit is worth, in queued requests (0: load-only placement)."""
    # prefix_weight 8: a smaller weight still recomputes shared prefixes on a second worker at no gain in
    # throughput (bench/NOTES-routing.md).

    direct_prefill_threshold: int = 256
    dead_after_intervals: float = 3.0
    prefix_weight: float = 8.0

    def __post_init__(self) -> None:
        if self.direct_prefill_threshold < 0:
            raise ValueError(f"direct_prefill_threshold must be >= 0, got {self.direct_prefill_threshold}")
        if not self.dead_after_intervals > 0:
            raise ValueError(f"dead_after_intervals must be > 0, got {self.dead_after_intervals}")
        if not (self.prefix_weight >= 0 and math.isfinite(self.prefix_weight)):
            raise ValueError(f"prefix_weight must be a finite number >= 0, got {self.prefix_weight}")


@dataclass(frozen=True)
class PlacementRequest:
    """What the policy needs to know of a request: its model, prompt length and generation budget."""

    request_id: str
    model: str
    prompt_len: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}")


# ---------------------------------------------------------------------------------------------
# the worker view
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerState:
    """One worker as the scheduler sees it: its last heartbeat plus what was placed on it since."""

    hb: WorkerHeartbeat
    last_seen: float
    inflight: int = 0
    inflight_pages: int = 0
    inflight_tokens: int = 0  # prompt tokens to compute placed since the heartbeat (prefill workers)
    suspended: bool = False

    @property
    def worker_id(self) -> str:
        return self.hb.worker_id

    @property
    def role(self) -> Role:
        return self.hb.role

    @property
    def free_pages(self) -> int:
        """Free pages after the placements made since the last heartbeat (0 while suspended)."""
        return 0 if self.suspended else max(0, self.hb.free_pages - self.inflight_pages)

    @property
    def decode_load(self) -> int:
        return self.hb.running + self.hb.pending + self.inflight

    @property
    def prefill_load(self) -> int:
        return self.hb.running + self.hb.waiting + self.inflight

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens this prefill worker has yet to compute, as far as the scheduler knows."""
        return self.hb.waiting_tokens + self.inflight_tokens

    def expires_at(self, dead_after_intervals: float) -> float:
        return expires_at(self.last_seen, self.hb.interval_ms, dead_after_intervals)

    def pages_for(self, tokens: int) -> int:
        """Pages this worker needs for a sequence of `tokens` tokens, capped at its context length."""
        return math.ceil(min(tokens, self.hb.max_context) / self.hb.page_size)


class WorkerTable:
    """Workers seen in heartbeats, with liveness and the scheduler's own placements since each heartbeat."""

    def __init__(self, dead_after_intervals: float = 3.0) -> None:
        if not dead_after_intervals > 0:
            raise ValueError(f"dead_after_intervals must be > 0, got {dead_after_intervals}")
        self.dead_after_intervals = dead_after_intervals
        self._workers: dict[str, WorkerState] = {}
        self._expiry: dict[str, float] = {}  # worker id -> when it is dead if unheard (same keys)
        # live() of the last call, valid from the time it was computed until its earliest expiry, unless
        # a heartbeat, a departure or an expiry changes the table first: (from, until, workers, page sizes)
        self._live: tuple[float, float, tuple[WorkerState, ...], frozenset[int]] | None = None

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def observe(self, hb: WorkerHeartbeat, now: float) -> None:
        """Take a heartbeat: it replaces the load estimate and lifts a suspension."""
        if hb.page_size < 1 or hb.interval_ms < 1 or hb.max_context < 1:
            raise ValueError(
                f"heartbeat of {hb.worker_id!r}: page_size, interval_ms and max_context must be >= 1 "
                f"(got {hb.page_size}, {hb.interval_ms}, {hb.max_context})"
            )
        s = self._workers[hb.worker_id] = WorkerState(hb=hb, last_seen=now)
        self._expiry[hb.worker_id] = s.expires_at(self.dead_after_intervals)
        self._live = None

    def gone(self, worker_id: str) -> bool:
        """Forget a worker at once (graceful shutdown); True if it was known."""
        self._expiry.pop(worker_id, None)
        self._live = None
        return self._workers.pop(worker_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Drop workers unheard for too long; returns their ids."""
        dead = [w for w, t in self._expiry.items() if now > t]
        for w in dead:
            del self._workers[w], self._expiry[w]
        if dead:
            self._live = None
        return dead

    def live(self, now: float) -> tuple[WorkerState, ...]:
        """Workers alive at `now` (draining ones included; the policy decides what they may take)."""
        return self._live_at(now)[2]

    def page_sizes(self, now: float) -> frozenset[int]:
        """The page sizes of the workers alive at `now` (the prefix lookup hashes a prompt for each)."""
        return self._live_at(now)[3]

    def _live_at(self, now: float) -> tuple[float, float, tuple[WorkerState, ...], frozenset[int]]:
        """The live set, computed again only when the table changed or a member's expiry passed (a
        worker already dead at `since` stays dead later), not per placement."""
        c = self._live
        if c is not None and c[0] <= now <= c[1]:
            return c
        ws, exp = self._workers, self._expiry
        live = [(w, t) for w, t in exp.items() if now <= t]
        members = tuple(ws[w] for w, _ in live)
        until = min((t for _, t in live), default=math.inf)
        self._live = c = (now, until, members, frozenset(s.hb.page_size for s in members))
        return c

    def next_expiry(self) -> float | None:
        """When the next worker would be declared dead if it stays silent (to wake a waiting loop)."""
        return min(self._expiry.values()) if self._expiry else None

    def note_placement(self, worker_id: str, pages: int = 0, tokens: int = 0) -> None:
        """Count a placement (its pages, its prompt tokens to compute) until the next heartbeat reports it."""
        s = self._workers.get(worker_id)
        if s is not None:
            s.inflight += 1
            s.inflight_pages += pages
            s.inflight_tokens += tokens

    def suspend(self, worker_id: str) -> None:
        """The worker refused or did not answer a reservation: place nothing on it until it is heard again."""
        s = self._workers.get(worker_id)
        if s is not None:
            s.suspended = True


# ---------------------------------------------------------------------------------------------
# decisions
# ---------------------------------------------------------------------------------------------


class PlanKind(enum.Enum):
    DIRECT = "direct"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class Plan:
    """Place the request: on `decode` alone (DIRECT) or prefill on `prefill` and decode on `decode`.
    `decode_pages` is the decode worker's page need (prompt + max_tokens), `uncached` the prompt tokens
    the prefilling worker must compute."""

    kind: PlanKind
    decode: str
    prefill: str | None
    num_tokens: int
    decode_pages: int
    uncached: int


@dataclass(frozen=True)
class Wait:
    """No capacity now; the request stays queued until a heartbeat changes the picture or it times out."""

    reason: str


@dataclass(frozen=True)
class Refuse:
    """The request cannot be served: `code` is HTTP-like (503 no live worker, 400 never fits)."""

    code: int
    message: str


Decision = Plan | Wait | Refuse


def placement_score(load: int, cached_tokens: int, prompt_len: int, prefix_weight: float) -> float:
    """Higher is better: prefix_weight x the cached share of the prompt, minus the worker's load."""
    return prefix_weight * min(max(cached_tokens, 0), prompt_len) / prompt_len - load


@dataclass(frozen=True)
class _Candidates:
    live: list[WorkerState] = field(default_factory=list)
    fits_context: list[WorkerState] = field(default_factory=list)


def serves(w: WorkerState, role: Role, model: str) -> bool:
    """The worker may take new requests of this role and model (draining ones take none)."""
    hb = w.hb
    return hb.role == role and hb.model == model and not hb.draining


def _candidates(workers: Iterable[WorkerState], role: Role, req: PlacementRequest) -> _Candidates:
    model = req.model  # `serves` inlined: this runs over every worker for every placement
    live = [w for w in workers if (hb := w.hb).role == role and hb.model == model and not hb.draining]
    # one token of room at least: a prompt that fills the whole context cannot generate anything
    plen = req.prompt_len
    return _Candidates(live=live, fits_context=[w for w in live if plen < w.hb.max_context])


def schedule(
    workers: Sequence[WorkerState],
    req: PlacementRequest,
    config: PolicyConfig,
    prefix_hits: Mapping[str, int] | None = None,
) -> Decision:
    """Decide where `req` runs, from the live workers (the rules: the module's comment). `prefix_hits` maps
    worker id -> prompt tokens in its prefix cache (the kv-broker's index): it lowers the uncached length
    and, weighed by `config.prefix_weight` against load, draws the request to the workers holding it."""
    # Single passes with the score inlined (this runs for every placement over every worker); they pick
    # exactly what `min` over the documented keys would, `placement_score` included.
    hits = prefix_hits or {}
    decode = _candidates(workers, Role.DECODE, req)
    if (refused := _unservable(decode, "decode", req)) is not None:
        return refused
    total = req.prompt_len + req.max_tokens
    d, fits_some = _best_decode(decode.fits_context, req.prompt_len, total, hits, config.prefix_weight)
    if not fits_some:
        return Refuse(
            ErrorCode.BAD_REQUEST,
            f"request needs more KV pages than any decode worker holds ({req.prompt_len} prompt + "
            f"{req.max_tokens} max tokens)",
        )
    if d is None:
        return Wait("no decode worker has enough free KV pages")
    d_pages = d.pages_for(total)
    uncached_on_decode = max(0, req.prompt_len - hits.get(d.worker_id, 0))
    threshold = config.direct_prefill_threshold
    if threshold > 0 and uncached_on_decode <= threshold:
        return Plan(PlanKind.DIRECT, d.worker_id, None, req.prompt_len, d_pages, uncached_on_decode)

    prefill = _candidates(workers, Role.PREFILL, req)
    if (refused := _unservable(prefill, "prefill", req)) is not None:
        return refused
    p = _best_prefill(prefill.fits_context, req.prompt_len, hits, config.prefix_weight)
    if p is None:
        return Wait("every prefill worker is suspended until its next heartbeat")
    uncached = max(0, req.prompt_len - hits.get(p.worker_id, 0))
    return Plan(PlanKind.DISAGGREGATED, d.worker_id, p.worker_id, req.prompt_len, d_pages, uncached)


def _best_decode(
    ws: list[WorkerState], plen: int, total: int, hits: Mapping[str, int], weight: float
) -> tuple[WorkerState | None, bool]:
    """(the decode worker with free pages for `total` tokens and the least (-score(decode_load),
    -free_pages, -hit, worker_id), whether any worker holds that many pages at all)."""
    placed = hits if weight > 0 else {}  # load-only placement ignores the cache entirely
    best, best_key, fits_some = None, None, False
    shape, need = (0, 0), 0  # pages_for(total) of the last (max_context, page_size) seen: workers share one
    for w in ws:
        hb = w.hb
        if (hb.max_context, hb.page_size) != shape:
            shape, need = (hb.max_context, hb.page_size), w.pages_for(total)
        fits_some = fits_some or need <= hb.total_pages
        free = 0 if w.suspended else max(0, hb.free_pages - w.inflight_pages)  # WorkerState.free_pages
        if free < need:
            continue
        h = placed.get(hb.worker_id, 0)
        load = hb.running + hb.pending + w.inflight  # WorkerState.decode_load
        score = weight * min(max(h, 0), plen) / plen - load  # placement_score
        if best_key is not None and -score > best_key[0]:
            continue  # worse on the first key already: no tuple to build
        key = (-score, -free, -h, hb.worker_id)
        if best_key is None or key < best_key:
            best, best_key = w, key
    return best, fits_some


def _best_prefill(
    ws: list[WorkerState], plen: int, hits: Mapping[str, int], weight: float
) -> WorkerState | None:
    """The unsuspended prefill worker with the least (-score(prefill_load), prefill_tokens, -hit, worker_id)."""
    placed = hits if weight > 0 else {}
    best, best_key = None, None
    for w in ws:
        if w.suspended:
            continue
        hb = w.hb
        h = placed.get(hb.worker_id, 0)
        score = weight * min(max(h, 0), plen) / plen - (hb.running + hb.waiting + w.inflight)
        key = (-score, hb.waiting_tokens + w.inflight_tokens, -h, hb.worker_id)
        if best_key is None or key < best_key:
            best, best_key = w, key
    return best


def _unservable(c: _Candidates, role: str, req: PlacementRequest) -> Refuse | None:
    """503 when no worker of the role is alive, 400 when the prompt fits none of their contexts."""
    if not c.live:
        return Refuse(ErrorCode.UNAVAILABLE, f"no live {role} worker for model {req.model!r}")
    if not c.fits_context:
        longest = max(w.hb.max_context for w in c.live)
        return Refuse(
            ErrorCode.BAD_REQUEST,
            f"prompt of {req.prompt_len} tokens does not fit the context of any {role} worker "
            f"(largest max_context {longest})",
        )
    return None
