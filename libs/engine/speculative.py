"""Speculative decoding with DeepSeek's MTP module as the draft model (`MTPEngine`): per step, verify last
step's k drafts in one target forward, accept (greedy: exactly greedy decoding's output; sampled: rejection
sampling, keeping the target's distribution), then draft k more with the MTP module. Drafts change speed only."""

# Legend: T tokens in a forward, V vocabulary, D hidden, k draft tokens.
# Verify: one target forward over [t_c, d_1..d_k] at positions c..c+k, absorbed MLA as plain decode runs it.
# Accept: greedy keeps drafts equal to the target's argmax, then adds the target's own token; sampled accepts
# d_i with probability min(1, p/q), else draws from max(p - q, 0) renormalized (Leviathan et al. 2023).
# Rejected drafts' KV rows are rolled back by moving num_computed back and returning pages past the tokens.
# Draft: the MTP module extends its cache over the verified positions (target hidden states, next tokens),
# giving d_1, then k-1 single-token steps feeding its own hidden state back.
# Drafts stay on the device (`DraftBatch`) and reach the host with the verify's argmax in one read, so a
# greedy step syncs once and returns while its draft runs; index tensors come from pinned memory. Prefill
# chunks run the same MTP extend, so its cache covers the prompt; a request without drafts (just joined from
# PD, or no page for draft rows) verifies only t_c. On paged backends verify and MTP steps run as decode rows
# (spec_graphs.py), from CUDA graphs where decode graphs are captured. Known limit: a PD-joined prompt's MTP
# rows are not transferred (its first drafts attend to stale rows). Under EP each rank runs one, its MTP
# module whole and local.

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from libs.engine.args import EngineArgs, with_overrides
from libs.engine.batcher import Plan, pages_for
from libs.engine.cuda_graph import GraphCaptureError, capture_sizes
from libs.engine.engine import Engine
from libs.engine.layers.attention_backend import StepInputs, TorchAttention
from libs.engine.loader import load_model
from libs.engine.models.deepseek_v3 import DeepseekV3ForCausalLM, MoE
from libs.engine.models.mtp import MTPLayer, load_mtp
from libs.engine.outputs import StepOutput
from libs.engine.request import Request, Status
from libs.engine.runner import Chunk, build_batch
from libs.engine.sampling import SamplingParams, TokenLogprob, sample, sampling_probs
from libs.engine.spec_graphs import IdsPatch, RowGraphRunner, chunk_rows, row_chunks
from libs.tokenizer import Tokenizer

log = logging.getLogger("moemesh.engine")


class DraftBatch:
    """One step's draft tokens, [S, k] int64 on the device (row i: the i-th drafting request's, the tail
    past its own k unused). The host reads them once, when first needed: with the next verify's argmax in
    one read where that verify took them on the device (`MTPEngine._verify`), else on their own."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.device_tokens = tokens
        self.host: list[list[int]] | None = None

    def rows(self) -> list[list[int]]:
        if self.host is None:
            self.host = self.device_tokens.tolist()
        return self.host


class Draft:
    """A request's draft tokens (a host list, or the first n of row `row` of a DraftBatch) and, for a
    sampled request, the distributions [k, V] they were drawn from."""

    def __init__(
        self, tokens: list[int] | None = None, probs: torch.Tensor | None = None, *,
        batch: DraftBatch | None = None, row: int = 0, n: int = 0,
    ) -> None:  # fmt: skip
        if (tokens is None) == (batch is None):
            raise ValueError("a Draft is a host token list or a row of a DraftBatch")
        self._tokens, self.probs, self.batch, self.row = tokens, probs, batch, row
        self.n = len(tokens) if tokens is not None else n

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            assert self.batch is not None
            self._tokens = self.batch.rows()[self.row][: self.n]
        return self._tokens


@dataclass
class Verified:
    """Target hidden states src[off:off+m] [m, D] at positions start..start+m-1 whose MTP rows are still
    to be made."""

    req: Request
    start: int
    src: torch.Tensor
    off: int
    m: int
    tokens: list[int] | None = None  # the m tokens after those positions (None: in req.tokens already)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index on `device` without a device sync: `torch.tensor(list, device="cuda")` copies from
    pageable memory and waits for the stream (for the graphs still running); a pinned copy does not."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def gather_rows(verified: Sequence[Verified]) -> torch.Tensor:
    """The verified hidden states [sum m, D], in order: one index_select where they share a forward."""
    src = verified[0].src
    if any(v.src is not src for v in verified):
        return torch.cat([v.src[v.off : v.off + v.m] for v in verified])
    rows = [r for v in verified for r in range(v.off, v.off + v.m)]
    if rows == list(range(src.shape[0])):
        return src
    return src.index_select(0, device_index(rows, src.device))


def _copy_from(src: torch.Tensor) -> IdsPatch:
    return lambda ids: ids.copy_(src)


def accept_greedy(target: list[int], drafted: list[int]) -> list[int]:
    """The target's argmax at t_c and each draft -> drafts while they match, then the target's token."""
    out: list[int] = []
    for d in drafted:
        if target[len(out)] != d:
            break
        out.append(d)
    return out + [target[len(out)]]


def accept_drafts(
    logits: torch.Tensor, draft: Draft | None, params: SamplingParams, gen: torch.Generator
) -> list[int]:
    """logits [n, V] of the target at t_c and each draft -> the tokens to emit (accepted drafts + one)."""
    drafted = draft.tokens if draft else []
    if params.greedy:
        return accept_greedy(logits.argmax(dim=-1).tolist(), drafted)
    p = sampling_probs(logits, [params] * logits.shape[0])  # [n, V]
    out: list[int] = []
    for i, d in enumerate(drafted):
        assert draft is not None and draft.probs is not None
        q = draft.probs[i]
        u = float(torch.rand((), generator=gen, device=gen.device))
        if u * float(q[d]) < float(p[i, d]):  # u < p/q without dividing by a tiny q
            out.append(d)
            continue
        residual = (p[i] - q).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return out + [int(torch.multinomial(dist, 1, generator=gen))]
    return out + [int(torch.multinomial(p[len(out)], 1, generator=gen))]


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], params: SamplingParams
) -> list[TokenLogprob] | None:
    """The raw-distribution logprob (and top alternatives) of each emitted token, as `sample` reports."""
    if not params.wants_logprobs:
        return None
    logp = logits[: len(tokens)].log_softmax(dim=-1)
    n_top = params.num_top_logprobs
    top_vals, top_ids = logp.topk(n_top, dim=-1) if n_top else (logp[:, :0], logp[:, :0].long())
    return [
        TokenLogprob(t, float(logp[i, t]), tuple(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True)))
        for i, t in enumerate(tokens)
    ]


def mtp_collector(read: Callable[[], tuple[int, int]]):
    """A Prometheus collector of MTP draft tokens verified and accepted, from `read() -> (drafted,
    accepted)` (one MTPEngine, or the sum over an EP group's ranks)."""
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.registry import Collector

    class _Collector(Collector):
        def collect(self):
            drafted, accepted = read()
            yield CounterMetricFamily(
                "moemesh_mtp_drafted_tokens", "MTP draft tokens verified", value=drafted
            )
            yield CounterMetricFamily(
                "moemesh_mtp_accepted_tokens", "MTP draft tokens accepted", value=accepted
            )

    return _Collector()


class MTPEngine(Engine):
    """The Engine with MTP speculative decoding of args.mtp_k (k >= 1) drafts per step."""

    def __init__(
        self, model: DeepseekV3ForCausalLM, mtp: MTPLayer, args: EngineArgs | None = None, *,
        tokenizer: Tokenizer | None = None, **overrides: Any,
    ) -> None:  # fmt: skip
        a = with_overrides(args, overrides)
        if a.mtp_k < 1:
            raise ValueError(f"MTPEngine needs mtp_k >= 1 draft tokens per step, got {a.mtp_k}")
        # the overlapped plain decode step would bypass verify and draft
        super().__init__(model, msgspec.structs.replace(a, overlap=False), tokenizer=tokenizer)
        self.mtp, self.k = mtp, a.mtp_k
        self.mtp_pool = mtp.new_kv_pool(self.kv_pool)
        if model.fast is not None:  # the target took the fused path (on CUDA by default): the block too
            mtp.enable_fast_path(model)
        self._drafts: dict[str, Draft] = {}
        # paged backends run verify and short MTP chunks as decode rows (spec_graphs.py), the reference
        # backend as absorbed multi-token chunks
        self._rows = not isinstance(self.runner.backend, TorchAttention)
        self.verify_graphs, self.draft_graphs = self._row_graphs()
        self.num_drafted = self.num_accepted = self.num_verified = 0

    @classmethod
    def load(cls, path: str | Path, args: EngineArgs | None = None, **overrides: Any) -> MTPEngine:
        """Engine.from_pretrained plus the checkpoint's MTP module; `args` and overrides as __init__ takes them."""
        a = with_overrides(args, overrides)
        model = load_model(path, dtype=a.resolved_dtype, device=a.device, quantization=a.quantization)
        mtp = load_mtp(path, model, a.quantization)
        tokenizer = Tokenizer.from_pretrained(path) if (Path(path) / "tokenizer.json").exists() else None
        return cls(model, mtp, a, tokenizer=tokenizer)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def stats(self) -> dict[str, int]:
        return super().stats() | {"mtp_drafted": self.num_drafted, "mtp_accepted": self.num_accepted}

    def register_metrics(self, registry) -> None:
        """Prometheus counters of drafted and accepted tokens (the worker calls this when it exists)."""
        registry.register(mtp_collector(lambda: (self.num_drafted, self.num_accepted)))

    # --- one step ---
    def _run(self, plan: Plan) -> list[StepOutput]:
        prefill = [(self.requests[rid], n) for rid, n in plan.prefill]
        decode = [self.requests[rid] for rid in plan.decode]
        for req, n in prefill + [(r, 1) for r in decode]:
            if req.num_computed + n > req.num_tokens:
                raise RuntimeError(f"plan feeds {req.rid!r} past its last token: {req.num_computed} + {n}")
            req.pages += self._alloc(plan.new_pages[req.rid])
        verified: list[Verified] = []
        outputs = self._prefill(prefill, verified) if prefill else []
        accepted = self._verify(decode, verified) if decode else []
        extended = self._extend(verified)  # launched before the per-request stop checks run on the host
        outputs += [self._emit(req, tokens, lps) for req, tokens, lps in accepted]
        if extended is not None:
            self._draft(*extended)
        return outputs

    def _target(self, chunks: Sequence[Chunk], absorbed: bool = False) -> torch.Tensor:
        batch = build_batch(chunks, self.page_size)
        mode = "absorbed" if absorbed else "auto"
        return self.model(batch, self.kv_pool, attn_mode=mode, backend=self.runner.backend)  # [T, D]

    def _prefill(self, items: list[tuple[Request, int]], verified: list[Verified]) -> list[StepOutput]:
        hidden = self._target([self._chunk(req, n) for req, n in items])
        last, done, off = [], [], 0
        for req, n in items:
            verified.append(Verified(req, req.num_computed, hidden, off, n))
            req.num_computed += n
            off += n
            if req.num_computed == req.num_tokens:
                last.append(off - 1)
                done.append(req)
        if not done:
            return []
        out = sample(
            self.model.compute_logits(hidden[last]), [r.params for r in done], [r.generator for r in done]
        )
        return [self._accept(r, t, lp) for r, t, lp in zip(done, out.token_ids, out.logprobs, strict=True)]

    def _verify(
        self, decode: list[Request], verified: list[Verified]
    ) -> list[tuple[Request, list[int], list[TokenLogprob] | None]]:
        """Verify the drafts: per request, the tokens to emit (accepted drafts + one) and their logprobs;
        the caller emits them (`_emit`) once the MTP extend over the verified rows is launched."""
        drafts = [self._drafts.pop(r.rid, None) for r in decode]
        fed = self._fed_drafts(drafts)
        chunks = []
        for r, d in zip(decode, drafts, strict=True):
            new = r.token_slice(r.num_computed, r.num_tokens - r.num_computed)  # [t_c]
            if d is not None:  # placeholders where the verify takes the drafts on the device
                new = new + ([0] * d.n if fed is not None else d.tokens)
            chunks.append(Chunk(new, r.num_computed, r.pages))
        hidden, logits = self._verify_forward(chunks, fed)
        argmax = self._read_argmax(logits, fed)
        out, off = [], 0
        for req, draft, chunk in zip(decode, drafts, chunks, strict=True):
            n = len(chunk.tokens)
            if req.params.greedy:  # one argmax for the whole batch, read per request
                tokens = accept_greedy(argmax[off : off + n], draft.tokens if draft else [])
            else:
                tokens = accept_drafts(logits[off : off + n], draft, req.params, req.generator)
            self.num_verified += 1
            self.num_drafted += n - 1
            self.num_accepted += len(tokens) - 1
            verified.append(Verified(req, req.num_computed, hidden, off, len(tokens), tokens))
            req.num_computed += len(tokens)
            out.append((req, tokens, token_logprobs(logits[off : off + n], tokens, req.params)))
            off += n
        return out

    def _fed_drafts(self, drafts: list[Draft | None]) -> tuple[DraftBatch, torch.Tensor | None] | None:
        """When the verify rows can take every request's drafts on the device (all k of them, from one
        DraftBatch not yet read, graphs on): the batch and the index of its rows in decode order (None:
        all rows in order). The host then reads them with the verify's argmax, one device sync."""
        if self.verify_graphs is None or not drafts or any(d is None or d.batch is None for d in drafts):
            return None
        batch = drafts[0].batch  # type: ignore[union-attr]
        assert batch is not None
        if batch.host is not None or batch.device_tokens.shape[1] != self.k:
            return None
        if any(d.batch is not batch or d.n != self.k for d in drafts):  # type: ignore[union-attr]
            return None
        rows = [d.row for d in drafts]  # type: ignore[union-attr]
        if rows == list(range(batch.device_tokens.shape[0])):
            return batch, None
        return batch, device_index(rows, batch.device_tokens.device)

    @staticmethod
    def _fed_tokens(fed: tuple[DraftBatch, torch.Tensor | None]) -> torch.Tensor:
        batch, rows = fed
        return batch.device_tokens if rows is None else batch.device_tokens.index_select(0, rows)

    def _read_argmax(
        self, logits: torch.Tensor, fed: tuple[DraftBatch, torch.Tensor | None] | None
    ) -> list[int]:
        """The target's argmax at every verify row on the host; a fed DraftBatch comes in the same read."""
        argmax = logits.argmax(dim=-1)
        if fed is None or fed[0].host is not None:
            return argmax.tolist()
        batch, n, k = fed[0], argmax.shape[0], self.k
        flat = torch.cat([argmax, batch.device_tokens.flatten()]).tolist()
        batch.host = [flat[i : i + k] for i in range(n, len(flat), k)]
        return flat[:n]

    def _emit(self, req: Request, tokens: list[int], lps: list[TokenLogprob] | None) -> StepOutput:
        """Append tokens one by one through the stop checks; a stop drops the tokens after it."""
        assert req.stopper is not None
        for i, token in enumerate(tokens):
            req.output_ids.append(token)
            if lps is not None:
                req.logprobs.append(lps[i])
            reason, stop_reason = req.stopper.check(token, len(req.output_ids))
            if reason is not None:
                req.num_computed = min(req.num_computed, req.num_tokens)
                return self._finish(req, reason, stop_reason, tokens[: i + 1], lps[: i + 1] if lps else None)
        self._trim_pages(req, req.num_tokens)
        return self._step_output(req, tokens, lps)

    def _trim_pages(self, req: Request, num_tokens: int) -> None:
        keep = max(pages_for(num_tokens, self.page_size), req.num_cached_pages)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            req.pages = req.pages[:keep]

    def _release(self, req: Request) -> None:
        self._drafts.pop(req.rid, None)
        super()._release(req)

    # --- drafting for the next step ---
    def _extend(self, verified: list[Verified]) -> tuple[list[Verified], list[Chunk], torch.Tensor] | None:
        """The MTP module over the verified positions of the live requests (a verified request that a stop
        check will end still gets its rows: harmless, its pages are freed after them in stream order).
        -> (those Verified, their chunks, the module's hidden [rows, D]), None when there are none."""
        live = [v for v in verified if v.req.status is Status.RUNNING and v.req.rid in self.requests]
        if not live:
            return None
        chunks = [
            Chunk(
                v.tokens if v.tokens is not None else v.req.token_slice(v.start + 1, v.m),
                v.start,
                v.req.pages,
            )
            for v in live
        ]
        return live, chunks, self._mtp_forward(chunks, gather_rows(live))

    def _draft(self, live: list[Verified], chunks: list[Chunk], g: torch.Tensor) -> None:
        """Draft for the extended requests still decoding after their stop checks."""
        ends = list(itertools.accumulate(len(c.tokens) for c in chunks))
        want = [
            (i, v.req, self._draft_len(v.req))
            for i, v in enumerate(live)
            if v.req.status is Status.RUNNING and v.req.rid in self.requests and v.req.in_decode
        ]
        want = [(i, r, k) for i, r, k in want if k > 0 and self._room_for_drafts(r, k)]
        if not want:
            return
        reqs, ks = [r for _, r, _ in want], [k for _, _, k in want]
        last = [ends[i] - 1 for i, _, _ in want]
        if last != list(range(g.shape[0])):  # [S, D]: the state after each request's newest token
            g = g.index_select(0, device_index(last, g.device))
        tokens, probs = self._chain(g, reqs, ks)
        batch = DraftBatch(tokens)
        for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            qs = probs[i]
            self._drafts[r.rid] = Draft(None, torch.stack(qs) if qs else None, batch=batch, row=i, n=k)

    def _chain(
        self, g: torch.Tensor, reqs: list[Request], ks: list[int]
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Draft ks[i] tokens per request from the MTP states g [S, D], on the device: each step's tokens
        feed the next step's rows there (no host read). -> tokens [S, max k] and sampled rows' q's."""
        cols: list[torch.Tensor] = []  # [S] per step
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        prev = torch.empty(0, dtype=torch.long, device=g.device)  # the last step's tokens [len(active)]
        base = [r.num_tokens - 2 for r in reqs]  # step j writes the MTP row at base + j
        for j in range(max(ks)):
            if j:  # one more position: the last draft as input, the module's own state as "hidden"
                still = [i for i in active if ks[i] > j]
                if len(still) < len(active):
                    keep = device_index([active.index(i) for i in still], g.device)
                    g, prev, active = g.index_select(0, keep), prev.index_select(0, keep), still
                steps = [Chunk([0], base[i] + j, reqs[i].pages) for i in active]
                g = self._mtp_forward(steps, g, prev)
            logits = self.mtp.compute_logits(g)
            tok = logits.argmax(dim=-1)
            for row, i in enumerate(active):
                if not reqs[i].params.greedy:
                    t, q = self._propose(logits[row], reqs[i])
                    tok[row : row + 1] = t
                    probs[i].append(q)
            if len(active) == len(reqs):
                cols.append(tok)
            else:
                cols.append(torch.zeros_like(cols[0]).index_copy_(0, device_index(active, g.device), tok))
            prev = tok
        return torch.stack(cols, dim=1), probs

    def _mtp_forward(
        self, chunks: Sequence[Chunk], hidden: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MTP module over short chunks, in latent space as the verify does (the expanded form would
        re-expand every cached row for a token or two); on paged backends as decode rows. tokens [T]
        (device), when given, replace the chunks' placeholder tokens (chained drafts)."""
        short = max(len(c.tokens) for c in chunks) <= self.k + 1
        if short and self._rows:
            patch = None if tokens is None else _copy_from(tokens)
            out = self._replay("draft_graphs", chunks, hidden, patch)
            if out is not None:
                return out[0]
            chunks = row_chunks(chunks)
        batch = build_batch(chunks, self.page_size)
        step = self.runner.backend.prepare(batch, self.page_size, short)
        if tokens is not None:
            step = dataclasses.replace(step, input_ids=tokens.to(step.input_ids.device, step.input_ids.dtype))
        return self.mtp.draft_step(step, hidden, self.mtp_pool)

    # --- verify and draft as decode rows, CUDA graphs (spec_graphs.py) ---
    def _verify_forward(
        self, chunks: Sequence[Chunk], fed: tuple[DraftBatch, torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's hidden [T, D] and float32 logits [T, V] at every token of the verify chunks. fed
        (`_fed_drafts`): the chunks' drafts are placeholders, their tokens on the device."""
        if self._rows:
            patch = None
            if fed is not None:
                drafts = self._fed_tokens(fed)
                patch = lambda ids: ids.view(-1, self.k + 1)[:, 1:].copy_(drafts)  # noqa: E731
            out = self._replay("verify_graphs", chunks, patch_ids=patch)
            if out is not None:
                return out[0], out[1]
        if fed is not None:  # no graph ran: the drafts come to the host
            rows = fed[0].rows()
            order = range(len(chunks)) if fed[1] is None else fed[1].tolist()
            chunks = [
                Chunk(c.tokens[:1] + rows[i], c.start, c.pages) for c, i in zip(chunks, order, strict=True)
            ]
        if self._rows:
            hidden = self._target(row_chunks(chunks))  # one-token chunks: the absorbed decode form
        else:
            hidden = self._target(chunks, absorbed=True)
        return hidden, self.model.compute_logits(hidden)

    def _verify_body(self, step: StepInputs, _: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.forward_step(step, self.kv_pool)
        return hidden, self.model.compute_logits(hidden)

    def _draft_body(self, step: StepInputs, hidden: torch.Tensor | None) -> tuple[torch.Tensor]:
        assert hidden is not None
        return (self.mtp.draft_step(step, hidden, self.mtp_pool),)

    def _row_graphs(self) -> tuple[RowGraphRunner | None, RowGraphRunner | None]:
        """Verify and draft graphs wherever the engine captures decode graphs (device, backend and model
        allow it), over their scratch page and table width; draft graphs need a graph-safe MTP block."""
        graphs = self.runner.graphs
        if graphs is None:
            return None, None
        sizes = capture_sizes(self.batcher.max_num_seqs * (self.k + 1))
        kw: dict[str, Any] = dict(
            page_size=self.page_size, scratch_page=graphs.scratch_page, max_pages=graphs.max_pages,
            device=self.model.device,
        )  # fmt: skip
        verify = RowGraphRunner(self._verify_body, self.runner.backend, sizes, **kw)
        mlp = self.mtp.mlp
        if isinstance(mlp, MoE) and not mlp.graph_safe:
            return verify, None
        # its own backend object: FlashInfer keeps one planned wrapper per captured size
        backend = self.model.attention_backend(self.runner.backend.name, self.kv_pool)
        cfg = self.config
        draft = RowGraphRunner(
            self._draft_body, backend, sizes, hidden_dim=cfg.hidden_size, hidden_dtype=self.model.dtype, **kw
        )
        return verify, draft

    def _replay(
        self, which: str, chunks: Sequence[Chunk], hidden=None, patch_ids: IdsPatch | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """The chunks' rows through `which` graphs ("verify_graphs" / "draft_graphs"); None when there are
        none, the rows do not fit, or the capture failed (those graphs are then off for this engine)."""
        runner: RowGraphRunner | None = getattr(self, which)
        if runner is None:
            return None
        tokens, positions, tables = chunk_rows(chunks)
        if not runner.can_run(len(tokens), positions):
            return None
        try:
            return runner.run(tokens, positions, tables, hidden, patch_ids)
        except GraphCaptureError:
            log.warning("MTP %s off for this engine: capture failed", which, exc_info=True)
            setattr(self, which, None)
            return None

    def _propose(self, logits: torch.Tensor, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled request's draft token [1] (on the device) from the MTP distribution q (filtered as
        the target's)."""
        q = sampling_probs(logits[None], [req.params])[0]
        return torch.multinomial(q, 1, generator=req.generator), q

    def _draft_len(self, req: Request) -> int:
        """k, but no draft past max_tokens or the context length."""
        left = req.params.max_tokens - len(req.output_ids) - 1
        room = self.config.max_position_embeddings - req.num_tokens
        return max(0, min(self.k, left, room))

    def _room_for_drafts(self, req: Request, k: int) -> bool:
        """Pages for the k draft rows, from free pages only (never evicting the prefix cache for them)."""
        extra = pages_for(req.num_tokens + k, self.page_size) - len(req.pages)
        if extra <= 0:
            return True
        if extra > self.allocator.num_free:
            return False
        req.pages += self.allocator.alloc(extra)
        return True
