"""Scenarios of overlapped decode (libs/engine/decode_pipeline.py) shared by its GPU tests (the captured
graph path, test_decode_pipeline.py) and its CPU tests (the eager mode, test_decode_pipeline_cpu.py): each
runs one engine without overlap and one with it (from `make(overlap)`) and checks that they agree."""

from __future__ import annotations

from collections.abc import Callable

from libs.engine.engine import Engine
from libs.engine.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 7], list(range(40, 61)), [9] * 30, [1, 2, 3]]

MakeEngine = Callable[[bool], Engine]  # overlap on or off


def count_drains(engine: Engine) -> list[int]:
    """The outputs of each drain of the overlapped path, as they happen (one that read tokens left it)."""
    drained: list[int] = []
    if engine._overlap is not None:
        drain = engine._overlap.drain

        def counted() -> list:
            out = drain()
            drained.append(len(out))
            return out

        engine._overlap.drain = counted  # type: ignore[method-assign]
    return drained


def pd_join(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> int:
    """A PD join: the prompt prefilled on one engine, its KV copied into the other's reserved pages (what
    the KV transfer writes), then add_prefilled. Returns the first token."""
    res = prefill.prefill(rid, prompt, params)
    pages = decode.reserve(rid, len(prompt))
    pool_p, pool_d = prefill.kv_pool, decode.kv_pool
    src = pool_p.buffer.view(pool_p.num_layers, -1, pool_p.page_size, pool_p.buffer.shape[-1])
    dst = pool_d.buffer.view(pool_d.num_layers, -1, pool_d.page_size, pool_d.buffer.shape[-1])
    dst[:, pages] = src[:, res.page_ids]
    prefill.release(rid)
    decode.add_prefilled(rid, prompt, res.first_token, params)
    return res.first_token


def assert_no_leak(engine: Engine) -> None:
    st = engine.stats()
    assert st["used_pages"] == st["cached_pages"] and st["running"] == 0 and not engine.has_unfinished()


def finishes_and_pd_joins_stay_in_the_overlap(make: MakeEngine, temperature: float = 0.8) -> None:
    """Requests that end (max_tokens, known ahead) or join with their KV in place do not drain the in-flight
    step, and the tokens are as without overlap. One request samples at `temperature` (0 where the plain
    step's sampler is not the one-pass kernel's: the CPU)."""
    params = [SamplingParams(temperature=temperature * (i == 1), seed=i, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    runs = []
    for overlap in (False, True):
        prefill, decode = make(False), make(overlap)
        drained = count_drains(decode)
        got = {f"r{i}": [pd_join(prefill, decode, f"r{i}", PROMPTS[i], params[i])] for i in range(3)}
        steps = 0
        while decode.has_unfinished():
            for out in decode.step():
                got[out.rid].extend(out.token_ids)
            steps += 1
            if steps == 3:  # two join while the first three run
                for i in (3, 4):
                    got[f"r{i}"] = [pd_join(prefill, decode, f"r{i}", PROMPTS[i], params[i])]
        assert [len(got[f"r{i}"]) for i in range(5)] == [6, 9, 12, 15, 18]
        assert_no_leak(decode)
        runs.append((got, drained))
    (plain, _), (fast, drained) = runs
    assert fast == plain
    assert sum(1 for n in drained if n) == 1, drained  # only after the last request's last token


def a_pool_full_of_cache_evicts_without_leaving_the_overlap(make: MakeEngine) -> None:
    """A decode worker's pool fills with cached prompts; a steady batch that needs a page then evicts from
    the cache inside the overlapped step. It used to count only free pages, drain and run the plain step
    each time the cache gave way: ~1 step in 7 of the served batch on the H200."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        engine = make(overlap)
        i = 0
        while engine.stats()["free_pages"] >= 6:  # finished prompts stay cached (evictable)
            prompt = [(7 * i + k) % 500 + 3 for k in range(100)]  # each its own first token: no shared prefix
            engine.add_request(
                f"fill{i}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            )
            while engine.has_unfinished():
                engine.step()
            i += 1
        cached = engine.stats()["cached_pages"]
        drained = count_drains(engine)
        for j, p in enumerate(PROMPTS[:4]):
            engine.add_request(f"r{j}", p, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.rid, []).extend(out.token_ids)
        assert [len(got[f"r{j}"]) for j in range(4)] == [40] * 4
        assert engine.stats()["cached_pages"] < cached, "the batch's pages came from the cache"
        assert_no_leak(engine)
        runs.append((got, drained))
    (plain, _), (fast, drained) = runs
    assert fast == plain
    assert sum(1 for n in drained if n) == 1, drained  # where the four end together (max_tokens)
