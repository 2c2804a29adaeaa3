"""Per-request sampling parameters (validated at construction, so everything past it can trust them) and
the batched sampler: one token per logits row under that row's own parameters and generator, so a seeded
request samples the same tokens whatever shares its batch."""

# Legend: S rows (sequences), V vocabulary.
# Filter order (as SGLang's): temperature, then top-k, top-p and min-p on the tempered distribution,
# renormalized. Logprobs are of the raw distribution (log_softmax before temperature or filters), as OpenAI's.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.engine.processing_params import GuidedSpec, needs_processing, validate_processing

MAX_TOP_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (invalid values raise ValueError naming the field), with OpenAI's and vLLM's
    meanings: temperature 0 is greedy, top_k -1 or 0 is off, `logprobs` a bool (chat) or an int n (completions).
    Penalties, logit_bias ((id, bias) pairs), min_tokens and `guided` apply in logits_processors.py."""
    # `stop` strings are matched on the detokenized output, cut before the match; `stop_token_ids` end the
    # request on that token.

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool | int = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    guided: GuidedSpec | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop) if stop is not None else ())
        ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(b) for b in bias))
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._validate_logprobs()
        validate_processing(self)

    def _validate_logprobs(self) -> None:
        if not isinstance(self.logprobs, bool | int):
            raise ValueError(f"logprobs must be a bool or an integer, got {self.logprobs!r}")
        if _is_int(self.logprobs) and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.top_logprobs and self.logprobs is False:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.top_logprobs and _is_int(self.logprobs) and self.logprobs != self.top_logprobs:
            raise ValueError(
                f"logprobs={self.logprobs} (an int) already sets the number of alternatives; "
                f"top_logprobs={self.top_logprobs} conflicts with it"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_processing(self) -> bool:
        """Penalties, bias, min_tokens or a grammar: the engine's LogitsProcessors must see this request."""
        return needs_processing(self)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is True or (_is_int(self.logprobs) and self.logprobs > 0)

    @property
    def num_top_logprobs(self) -> int:
        """How many alternatives to report with each chosen token's logprob."""
        if _is_int(self.logprobs):
            return int(self.logprobs)
        return self.top_logprobs if self.logprobs else 0


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's own generator: seeded if asked, else from fresh OS entropy (never the global RNG)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def _filter_tempered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[S, V] tempered logits with the top-k / top-p / min-p rejects set to -inf."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1 for p in top_p) and all(m <= 0 for m in min_p):
        return logits
    sorted_logits, order = logits.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    reject = ranks >= torch.tensor(top_k, device=dev).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(reject, float("-inf"))
    probs = sorted_logits.softmax(dim=1)
    # top-p: drop a token when the tokens strictly better than it already reach top_p (rank 0 always stays).
    mass_before = probs.cumsum(dim=1) - probs
    p_limit = torch.tensor(top_p, dtype=probs.dtype, device=dev).unsqueeze(1)
    reject |= (mass_before >= p_limit) & (p_limit < 1)
    # min-p: drop tokens less likely than min_p times the best one.
    m_limit = torch.tensor(min_p, dtype=probs.dtype, device=dev).unsqueeze(1)
    reject |= probs < m_limit * probs[:, :1]
    reject[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(reject, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row; row i's randomness comes only from generators[i] (exponential race)."""
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    return (probs / noise).argmax(dim=1)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def one_pass_ok(p: SamplingParams) -> bool:
    """Rows the one-pass Gumbel-max kernel samples exactly: greedy, or a temperature alone (no top-k/p or
    min-p). Logprobs of the chosen token alone come from the same pass, unless logits processing runs
    (logprobs report the logits before it); top alternatives do not."""
    if p.wants_logprobs and (p.num_top_logprobs or p.needs_processing):
        return False
    return p.greedy or (p.top_k in (0, -1) and p.top_p >= 1 and p.min_p <= 0)


def chosen_logprobs(
    tokens: list[int], logprobs: torch.Tensor | None, params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """The one-pass rows' logprobs (`one_pass_sample`'s, None when no row asked) as the exact sampler reports
    them, without alternatives, for the rows that want them."""
    if logprobs is None:
        return [None] * len(params)
    return [
        TokenLogprob(t, lp) if p.wants_logprobs else None
        for t, lp, p in zip(tokens, logprobs.tolist(), params, strict=True)
    ]


def sample(
    logits: torch.Tensor,  # [S, V] float32 (or the model's 16-bit logits)
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    keys: Sequence[tuple[int, int]] | None = None,
    raw_logits: torch.Tensor | None = None,
) -> SampleOutput:
    """Sample one token per row (greedy rows take the argmax, no noise). keys: (seed, position) per row, for
    the one-pass Gumbel-max kernel on CUDA rows that `one_pass_ok`; other rows take the exact sampler with
    their generator. raw_logits (default `logits`): before logits processing, what logprobs report."""
    # The kernel's noise comes from seed and position (libs.kernels.gumbel), so a request draws the same
    # whatever shares its batch, and a prefill and a decode side agree.
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample() needs logits [S, V] with S == len(params) == len(generators); got "
            f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators"
        )
    raw = logits if raw_logits is None else raw_logits
    if keys is not None and logits.is_cuda:
        fast = [i for i, p in enumerate(params) if one_pass_ok(p)]
        if len(fast) == len(params):
            ids, lps = one_pass_sample(logits, params, keys)
            token_list = ids.tolist()
            return SampleOutput(token_list, chosen_logprobs(token_list, lps, params))
        if fast:
            tokens = _exact(logits, params, generators)
            idx = torch.tensor(fast, device=logits.device)
            picked, _ = one_pass_sample(logits[idx], [params[i] for i in fast], [keys[i] for i in fast])
            tokens[idx] = picked
            token_list = tokens.tolist()
            return SampleOutput(token_list, _logprobs(raw, token_list, params))
    tokens = _exact(logits, params, generators)
    token_list = tokens.tolist()
    return SampleOutput(token_list, _logprobs(raw, token_list, params))


def one_pass_sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([S] int64 token ids, [S] float32 chosen-token logprobs or None when no row wants them), both on the
    device, for rows that `one_pass_ok` only (no host sync)."""
    from libs.kernels.gumbel import gumbel_sample

    host = torch.tensor(
        [[0.0 if p.greedy else p.temperature, s & 0x7FFF_FFFF_FFFF, pos] for p, (s, pos) in zip(params, keys, strict=True)],
        dtype=torch.float64,
    )
    dev = host.to(logits.device, non_blocking=True)
    lps = torch.empty(len(params), dtype=torch.float32, device=logits.device) if any(p.wants_logprobs for p in params) else None
    ids = gumbel_sample(logits.contiguous(), dev[:, 0].float(), dev[:, 1].long(), dev[:, 2].long(), logprobs=lps)
    return ids, lps


def _exact(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]):
    logits = logits.float()
    tokens = logits.argmax(dim=1)
    rand_rows = [i for i, p in enumerate(params) if not p.greedy]
    if rand_rows:
        idx = torch.tensor(rand_rows, device=logits.device)
        sub_params = [params[i] for i in rand_rows]
        probs = _filter_tempered(logits[idx], sub_params).softmax(dim=1)
        tokens[idx] = _draw(probs, [generators[i] for i in rand_rows])
    return tokens


def _logprobs(
    logits: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.wants_logprobs]
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    logp = logits[idx].float().log_softmax(dim=1)
    n_top = max(params[i].num_top_logprobs for i in rows)
    top_vals, top_ids = logp.topk(min(n_top, logp.shape[1]), dim=1) if n_top else (None, None)
    for j, i in enumerate(rows):
        k = params[i].num_top_logprobs
        top: tuple[tuple[int, float], ...] = ()
        if k and top_ids is not None and top_vals is not None:
            top = tuple(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
        out[i] = TokenLogprob(tokens[i], float(logp[j, tokens[i]]), top)
    return out


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[S, V] the distribution `sample` draws row i from (temperature, top-k/p, min-p applied), for
    non-greedy params; speculative decoding's rejection sampling compares these."""
    return _filter_tempered(logits.float(), params).softmax(dim=1)
