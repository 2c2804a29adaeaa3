"""The offline tune step of the FP8 GEMMs (`moemesh tune`, `python -m bench.tune_gemm`): a worker's warm-up run
stage by stage through the caller's engine inside `gemm_tuning.tuning(table_dir)`, so every GEMM shape a
server meets is timed and its fastest kernel written to the table (a run cut short keeps what it tuned)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.kernels import gemm_tuning


def stages(engine: Any, max_prefill_tokens: int, max_num_seqs: int) -> list[tuple[str, Any]]:
    """(name, WarmupPlan) per stage of a worker that both prefills up to max_prefill_tokens and decodes every
    graph size: one stage per prompt length and per decode batch."""
    from libs.worker.warmup import WarmupPlan, plan_warmup

    plan = plan_warmup(
        max_prefill_tokens, max_num_seqs, page_size=engine.page_size, free_pages=engine.stats()["free_pages"],
        context_len=engine.config.max_position_embeddings, decode=True,
    )  # fmt: skip
    return [(f"prefill {n}", WarmupPlan((n,), ())) for n in plan.prefill_lens] + [
        (f"decode {b}", WarmupPlan((), (b,))) for b in plan.decode_batches
    ]


def tune_engine(
    engine: Any, max_prefill_tokens: int, max_num_seqs: int, table_dir: str | Path, *, retune: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Every warm-up stage through `engine` inside the tune step, writing `table_dir`'s table; -> a record:
    seconds, tuning seconds and shapes tuned per stage, totals, rejected candidates, the table's path."""
    from libs.worker.warmup import run_warmup

    done: list[dict[str, Any]] = []
    t_all, spent0, timings0 = time.perf_counter(), gemm_tuning.SPENT["seconds"], gemm_tuning.SPENT["timings"]
    with gemm_tuning.tuning(table_dir, retune=retune) as path:
        for name, plan in stages(engine, max_prefill_tokens, max_num_seqs):
            before, spent = len(gemm_tuning.TIMINGS), gemm_tuning.SPENT["seconds"]
            report = run_warmup(engine, plan)
            tuning = gemm_tuning.SPENT["seconds"] - spent
            tuned = len(gemm_tuning.TIMINGS) - before
            done.append(
                {"stage": name, "s": round(report.seconds, 3), "tuning_s": round(tuning, 3), "tuned": tuned}
            )
            log(f"{name:>14}: {report.seconds:7.2f} s ({tuning:.2f} s tuning {tuned} shapes)")
    return {
        "device": gemm_tuning.device_tag(),
        "stages": done,
        "total_s": time.perf_counter() - t_all,
        "tuned": sum(stage["tuned"] for stage in done),
        "tuning_s": gemm_tuning.SPENT["seconds"] - spent0,
        "timings": gemm_tuning.SPENT["timings"] - timings0,
        "rejected": {str(k): v for k, v in gemm_tuning.REJECTED.items()},
        "table": str(path),
    }
