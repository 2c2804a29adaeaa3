"""Pure batch planning for continuous batching: `Batcher.schedule(running, waiting, free_pages) -> Plan`, over
the engine's `SeqView`s (no tensors, no allocator). Page accounting is conservative, so the engine's
allocation for a plan cannot fail."""

# One step: (1) decode: every running request past its prompt gets one token (and a page when it starts
# one); short of pages, the newest running requests are preempted back to waiting, as vLLM does. (2) chunked
# prefill: running prompts continue, then waiting requests are admitted FIFO, sharing `max_prefill_tokens`;
# admission stops at the first that does not fit (no overtaking: long prompts are not starved) or at
# `max_num_seqs`. Accounting: `free_pages` is free + evictable; admitting charges the whole prompt, cached
# prefix included (locking it can make those pages unevictable); preempting credits only the pages the
# request owns beyond its matched prefix (others may share the prefix).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.engine.args import DEFAULTS


@dataclass(frozen=True)
class SeqView:
    """What the planner needs of one request.

    For a waiting request num_computed is the prefix-cache hit it would start from and num_pages 0."""

    rid: str
    num_computed: int  # tokens whose KV is (or, for waiting, would be) in the pool
    num_tokens: int  # prompt + outputs so far
    num_pages: int = 0  # pages held now
    num_cached_pages: int = 0  # of those, pages shared from the prefix cache
    decoding: bool = False  # prompt done: the next step feeds exactly the newest token


@dataclass
class Plan:
    decode: list[str] = field(default_factory=list)  # rids that feed their newest token
    prefill: list[tuple[str, int]] = field(default_factory=list)  # (rid, new tokens) in order
    admit: list[str] = field(default_factory=list)  # waiting rids that start running (all in prefill)
    preempt: list[str] = field(default_factory=list)  # running rids sent back to waiting
    new_pages: dict[str, int] = field(default_factory=dict)  # pages to allocate per rid this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Batcher:
    def __init__(
        self, page_size: int, max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_prefill_tokens: int = DEFAULTS.max_prefill_tokens,
    ) -> None:  # fmt: skip
        if page_size < 1 or max_num_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError(
                "page_size, max_num_seqs and max_prefill_tokens must be >= 1, got "
                f"{page_size}, {max_num_seqs}, {max_prefill_tokens}"
            )
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens

    def schedule(self, running: Sequence[SeqView], waiting: Sequence[SeqView], free_pages: int) -> Plan:
        """Plan one step. `running` is in admission order (oldest first); `waiting` in queue order."""
        active = list(running)
        forced: list[SeqView] = []
        while True:
            plan = Plan(preempt=[v.rid for v in forced])
            budget = free_pages + sum(v.num_pages - v.num_cached_pages for v in forced)
            budget = self._plan_decode(active, plan, budget)
            budget, reserved, tokens_left = self._plan_chunks(active, plan, budget)
            self._plan_admissions(waiting, len(active), plan, budget - reserved, tokens_left)
            if not plan.empty or len(active) <= 1:
                return plan
            # Every running request is stuck in its prompt for want of pages: let the older ones through.
            forced = [v for v in running if v.rid in plan.preempt] + [active.pop()]

    def _plan_chunks(self, active: list[SeqView], plan: Plan, budget: int) -> tuple[int, int, int]:
        """Next prompt chunk of each running request still in its prompt; returns (pages left, pages kept back
        for the rest of those prompts, prefill tokens left). What is kept back cannot go to admissions, so a
        half-done prompt is never starved of pages by newcomers."""
        tokens_left, reserved = self.max_prefill_tokens, 0
        for seq in active:
            if seq.decoding:
                continue
            rest = max(pages_for(seq.num_tokens, self.page_size) - seq.num_pages, 0)
            can_hold = (seq.num_pages + budget) * self.page_size - seq.num_computed
            chunk = min(seq.num_tokens - seq.num_computed, tokens_left, can_hold)
            need = 0
            if chunk > 0:
                need = max(pages_for(seq.num_computed + chunk, self.page_size) - seq.num_pages, 0)
                budget -= need
                tokens_left -= chunk
                plan.prefill.append((seq.rid, chunk))
                plan.new_pages[seq.rid] = need
            reserved += rest - need
        return budget, reserved, tokens_left

    def _plan_decode(self, active: list[SeqView], plan: Plan, budget: int) -> int:
        """Give each decoding request its next slot, preempting from the newest end; returns pages left."""
        idx = 0
        while idx < len(active):
            seq = active[idx]
            if not seq.decoding:
                idx += 1
                continue
            need = max(pages_for(seq.num_computed + 1, self.page_size) - seq.num_pages, 0)
            while need > budget and len(active) > idx + 1:
                budget += self._preempt(active.pop(), plan)
            if need > budget:  # nothing newer left to preempt: this one waits instead
                budget += self._preempt(active.pop(), plan)
                break
            budget -= need
            plan.decode.append(seq.rid)
            plan.new_pages[seq.rid] = need
            idx += 1
        return budget

    @staticmethod
    def _preempt(victim: SeqView, plan: Plan) -> int:
        plan.preempt.append(victim.rid)
        return victim.num_pages - victim.num_cached_pages

    def _plan_admissions(
        self, waiting: Sequence[SeqView], num_running: int, plan: Plan, budget: int, tokens_left: int
    ) -> None:
        for seq in waiting:
            if num_running >= self.max_num_seqs or tokens_left <= 0:
                return
            whole = pages_for(seq.num_tokens, self.page_size)
            if whole > budget:
                return
            chunk = min(seq.num_tokens - seq.num_computed, tokens_left)
            budget -= whole
            tokens_left -= chunk
            num_running += 1
            plan.admit.append(seq.rid)
            plan.prefill.append((seq.rid, chunk))
            plan.new_pages[seq.rid] = pages_for(seq.num_computed + chunk, self.page_size) - (
                seq.num_computed // self.page_size
            )
