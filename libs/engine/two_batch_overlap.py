"""Two-batch overlap (TBO): one forward run as two micro-batches whose layers interleave, so one micro-batch's
EP dispatch/combine is in flight while the other computes (SGLang's two_batch_overlap.py). With no EP hook
nothing is communicated: TBO only splits the batch, and the outputs must not change."""

# Legend: T tokens, S sequences, D hidden, K experts per token, L layers.
# Split (`split_index`, `split_step`) by sequences: a decode batch in half, an extend batch where half its
# tokens are reached. Micro-batches read views of the step's inputs and metadata, so a captured decode graph
# holds the split forward too. FlashInfer plans one wrapper per decode micro-batch (`plan_micro_batches`, or
# `plan_graph` before a replay; the metadata's `part` names which); its extend forwards run whole.
# Schedule: each micro-batch's forward is a generator yielding three stages per layer: 0 attention + router,
# 1 dispatch launch + shared experts, 2 dispatch wait + local experts + combine launch (the next 0 waits on
# the combine). `run_overlapped` runs A two stages ahead, then alternates B, A: collectives launch in the
# sequential rounds' order (A's, then B's), while each flies over the other micro-batch's compute. Dense
# layers and fused local MoEs yield as often with nothing in flight, so the generators stay in step.
# An EP hook with `stages(x, ids, weights)` uses its dispatcher's dispatch_start/combine_start (async
# torch.distributed work); one without runs its whole MoE in stage 1. An EP group runs TBO on every rank or
# none: each forward is two micro-batches (the second empty for one sequence), each MoE layer two rounds.

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from libs.engine.layers import fast_path, fp8_linear
from libs.engine.layers.attention_backend import AttentionBackend, StepInputs
from libs.engine.layers.mla import AttentionMetadata, PagedMetadata
from libs.engine.tbo_split import split_index

Stages = Generator[None, None, Any]  # yields between stages, returns the micro-batch's output
BACKENDS = ("torch", "triton", "flashinfer")




def split_step(step: StepInputs, s: int) -> tuple[StepInputs, StepInputs]:
    """The step's first s sequences and the rest, as views (0 < s < S)."""
    meta = step.meta
    parts: list[PagedMetadata | AttentionMetadata]
    if isinstance(meta, PagedMetadata):
        ext = meta.extend_lens if meta.extend_lens is not None else [1] * meta.seq_lens.shape[0]
        t = sum(ext[:s])
        parts = [_paged_part(meta, slice(0, s), ext[:s], 0), _paged_part(meta, slice(s, None), ext[s:], 1)]
        plan = getattr(step.backend, "plan_micro_batches", None)
        if plan is not None and step.absorbed:
            plan(meta, s)
    elif isinstance(meta, AttentionMetadata):
        t = int(meta.q_valid[:s].sum())
        parts = [_torch_part(meta, slice(0, s), 0), _torch_part(meta, slice(s, None), t)]
    else:
        raise TypeError(f"two-batch overlap cannot split {type(meta).__name__}")
    tokens = (slice(0, t), slice(t, None))
    return tuple(  # type: ignore[return-value]
        replace(step, input_ids=step.input_ids[tk], positions=step.positions[tk], out_slots=step.out_slots[tk],
                meta=m)  # fmt: skip
        for tk, m in zip(tokens, parts, strict=True)
    )


def _paged_part(meta: PagedMetadata, rows: slice, ext: list[int], part: int) -> PagedMetadata:
    """One micro-batch's rows of the paged metadata, keeping the whole step's split-K count for the Triton MLA
    decode: re-chosen for half the sequences it would add splits that the SMs do not need (a half batch fills
    them already) and that cost a combine pass and fp32 partials (bench/NOTES-code-history.md)."""
    return PagedMetadata(
        meta.page_table[rows], meta.seq_lens[rows], meta.page_size, meta.num_splits,
        None if meta.extend_lens is None else ext, None if meta.kv_lens is None else meta.kv_lens[rows], part,
    )  # fmt: skip


def _torch_part(meta: AttentionMetadata, rows: slice, first_token: int) -> AttentionMetadata:
    return AttentionMetadata(meta.kv_slots[rows], meta.mask[rows], meta.q_index[rows] - first_token, meta.q_valid[rows])


def run_overlapped(a: Stages, b: Stages, delta: int = 2) -> tuple[Any, Any]:
    """Run two stage generators: `delta` stages of A, then B and A alternately; -> their return values."""
    done: dict[str, Any] = {}

    def advance(name: str, gen: Stages) -> None:
        if name in done:
            return
        try:
            next(gen)
        except StopIteration as stop:
            done[name] = stop.value

    for _ in range(delta):
        advance("a", a)
    while len(done) < 2:
        advance("b", b)
        advance("a", a)
    return done["a"], done["b"]


def run_alone(gen: Stages) -> Any:
    """A stage generator run to the end (the sequential forward of the same code)."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


# --- one micro-batch's forward, as stages ---


def _route(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE's router as MoE.forward runs it: -> weights [T, K] float32, logical ids [T, K]."""
    if moe.experts.is_fp8:
        routed = fp8_linear.fused_route(moe.gate, x)
        if routed is not None:
            return routed
    return moe.gate(x)


def mlp_stages(mlp, x: torch.Tensor, fused: bool) -> Stages:
    """Stages 1 and 2 of a layer's MLP (two yields) -> its output [T, D] (the combine waited in stage 0 of
    the next layer). `fused`: the fast path's local-expert MoE."""
    hook = getattr(mlp, "ep", None)
    stages = getattr(hook, "stages", None)
    if stages is None:
        y = fast_path.moe(mlp, x) if fused else mlp(x)
        yield
        yield
        return y
    weights, ids = _route(mlp, x)
    routed = stages(x, ids, weights)  # yields twice: after the dispatch launch, after the combine launch
    next(routed)
    shared = mlp.shared_experts(x) if mlp.shared_experts is not None else None
    yield
    next(routed)
    yield
    y = run_alone(routed)
    return y if shared is None else y + shared


def empty_stages(model, hidden: int, dtype: torch.dtype) -> Stages:
    """A micro-batch with no tokens in an EP group: every MoE layer's two rounds with nothing to send."""
    x = torch.empty(0, hidden, dtype=dtype, device=model.device)
    k = model.config.num_experts_per_tok
    for layer in model.model.layers:
        yield
        stages = getattr(getattr(layer.mlp, "ep", None), "stages", None)
        if stages is None:
            yield
            yield
            continue
        ids = torch.empty(0, k, dtype=torch.int64, device=x.device)
        yield from stages(x, ids, torch.empty(0, k, dtype=torch.float32, device=x.device))
    return x


def plain_stages(model, step: StepInputs, kv) -> Stages:
    """The model's plain forward (DecoderLayer.forward) over one micro-batch -> normed hidden [T, D]."""
    x = F.embedding(step.input_ids, model.model.embed_tokens.weight)
    cos, sin = model.rope.cos_sin(step.positions)
    for layer in model.model.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, step, kv)
        h = layer.post_attention_layernorm(x)
        yield
        x = x + (yield from mlp_stages(layer.mlp, h, fused=False))
    return model.model.norm(x)


def fused_stages(model, step: StepInputs, kv) -> Stages:
    """The fast path's forward (fast_path.decoder_layer) over one micro-batch -> normed hidden [T, D]."""
    from libs.kernels import fused

    fast = model.fast
    h = F.embedding(step.input_ids, model.model.embed_tokens.weight)
    residual = torch.zeros_like(h)
    for layer in model.model.layers:
        x8 = fused.add_rmsnorm_quant(h, layer.input_layernorm.weight, fast.eps, residual=residual)
        a = fast_path.attention(layer.self_attn, x8, step, kv, fast)
        x = fused.add_rmsnorm(a, layer.post_attention_layernorm.weight, fast.eps, residual=residual)
        yield
        mlp = layer.mlp
        local = getattr(mlp, "fast", None) is not None and mlp.ep is None
        h = yield from mlp_stages(mlp, x, fused=local)
    return fast_path.final_norm(model.model.norm, h, residual, fast)


class TwoBatchOverlap:
    """What `DeepseekV3ForCausalLM.tbo` is set to (`enable`): its forward_step over two micro-batches. paired:
    every forward is two micro-batches (an EP group's ranks, whose MoE rounds come in pairs), the second empty
    for a single sequence; else such a batch runs whole."""

    def __init__(self, paired: bool = False, delta: int = 2) -> None:
        self.paired, self.delta = paired, delta
        self.split_forwards = 0  # forwards run as two non-empty micro-batches

    def forward_step(self, model, step: StepInputs, kv) -> torch.Tensor:
        stages = fused_stages if model.fast is not None and model.uses_fast_path(step.backend) else plain_stages
        n = step.meta.seq_lens.shape[0] if isinstance(step.meta, PagedMetadata) else step.meta.q_index.shape[0]
        ext = getattr(step.meta, "extend_lens", None)
        s = split_index(ext if ext is not None else [1] * n) if n > 1 else n
        whole = not step.absorbed and not getattr(step.backend, "splits_extend", True)
        if 0 < s < n and not whole:
            a, b = split_step(step, s)
            self.split_forwards += 1
            ha, hb = run_overlapped(stages(model, a, kv), stages(model, b, kv), self.delta)
            return torch.cat([ha, hb])
        if not self.paired:
            return run_alone(stages(model, step, kv))
        empty = empty_stages(model, model.config.hidden_size, model.dtype)
        h, _ = run_overlapped(stages(model, step, kv), empty, self.delta)
        return h


def check_backend(backend: AttentionBackend) -> None:
    if backend.name not in BACKENDS:
        raise ValueError(
            f"two-batch overlap splits the attention metadata of the {BACKENDS} backends, not {backend.name!r}"
        )


def enable(model, backend: AttentionBackend) -> TwoBatchOverlap:
    """Run every forward of `model` as two overlapped micro-batches (ValueError for a backend it cannot split);
    paired when a MoE layer has an expert-parallel hook (an EP rank)."""
    check_backend(backend)
    if hasattr(backend, "tbo"):  # FlashInfer: plan a wrapper per micro-batch
        backend.tbo = True
    paired = any(getattr(layer.mlp, "ep", None) is not None for layer in model.model.layers)
    model.tbo = TwoBatchOverlap(paired)
    return model.tbo
