"""Tune a model's FP8 GEMMs once, ahead of serving, into a tuning table (libs/kernels/gemm_tuning.py): the
workers' own warm-up (libs/worker/warmup.py) run stage by stage through the Engine, each stage timed, every
choice written to the table as it is made (a run cut short keeps what it tuned).

    python -m bench.tune_gemm [--layers 4 --experts 16 --top-k 8] [--table-dir libs/kernels/tuning]
    python -m bench.tune_gemm --smoke --device cpu       # the tiny model: runs the stages, tunes nothing

The default folder is the one the project ships (read by every process on a device of the same name and
Triton version); serving_gpu's preset model and settings, so `moemesh up --device cuda` on that model finds
each of its GEMM shapes tuned (SGLang and vLLM ship their Triton GEMM configs per device likewise). Writes a
record `benchmark` "tune_gemm": seconds per stage, choices made, the table's path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import write_results
from libs.kernels import gemm_tuning


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="the tiny model (CPU, CI)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=0, help="decode batch sizes up to it (serving_gpu's)")
    ap.add_argument("--table-dir", default=str(gemm_tuning.SHIPPED_DIR), help="where the table is written")
    return ap.parse_args(argv)


def stages(engine: Any, engine_kwargs: dict[str, Any]) -> list[Any]:
    """The warm-up plan of a worker that both prefills up to max_prefill_tokens and decodes every graph
    size, one stage per prompt length and per decode batch."""
    from libs.worker.warmup import WarmupPlan, plan_warmup

    plan = plan_warmup(
        engine_kwargs["max_prefill_tokens"], engine_kwargs["max_num_seqs"], page_size=engine.page_size,
        free_pages=engine.stats()["free_pages"], context_len=engine.config.max_position_embeddings,
        decode=True,
    )  # fmt: skip
    return [WarmupPlan((n,), ()) for n in plan.prefill_lens] + [WarmupPlan((), (b,)) for b in plan.decode_batches]


def run(a: argparse.Namespace) -> dict[str, Any]:
    os.environ[gemm_tuning.CACHE_ENV] = a.table_dir  # before the first choice: each one lands there
    from bench.serving_gpu import parse_args as serving_args
    from bench.serving_gpu import settings, write_model
    from libs.engine import Engine
    from libs.worker.warmup import run_warmup

    flags = ["--device", a.device, "--layers", str(a.layers), "--experts", str(a.experts)]
    flags += ["--top-k", str(a.top_k), "--concurrency", str(a.concurrency)] + (["--smoke"] if a.smoke else [])
    sa = serving_args(flags)
    s = settings(sa)
    with tempfile.TemporaryDirectory(prefix="tune-gemm-") as tmp:
        model = write_model(sa, Path(tmp))
        engine = Engine.from_pretrained(model["dir"], device=a.device, dtype=s.dtype, **s.engine_kwargs())
        rec: dict[str, Any] = {"benchmark": "tune_gemm", "device": gemm_tuning.device_tag(), "model": model}
        done: list[dict[str, Any]] = []
        rec["stages"] = done
        t_all, spent0 = time.perf_counter(), dict(gemm_tuning.SPENT)  # this run's share of the process's counts
        for plan in stages(engine, s.engine_kwargs()):
            before, spent = len(gemm_tuning.TIMINGS), gemm_tuning.SPENT["seconds"]
            report = run_warmup(engine, plan)
            what = f"prefill {plan.prefill_lens[0]}" if plan.prefill_lens else f"decode {plan.decode_batches[0]}"
            tuning = gemm_tuning.SPENT["seconds"] - spent
            tuned = len(gemm_tuning.TIMINGS) - before
            done.append({"stage": what, "s": round(report.seconds, 3), "tuning_s": round(tuning, 3), "tuned": tuned})
            print(f"{what:>14}: {report.seconds:7.2f} s ({tuning:.2f} s tuning {tuned} shapes)", flush=True)
    rec["total_s"] = time.perf_counter() - t_all
    rec["tuned"] = sum(stage["tuned"] for stage in done)
    rec["tuning_s"] = gemm_tuning.SPENT["seconds"] - spent0["seconds"]
    rec["timings"] = gemm_tuning.SPENT["timings"] - spent0["timings"]
    rec["rejected"] = {str(k): v for k, v in gemm_tuning.REJECTED.items()}
    rec["table"] = str(Path(a.table_dir) / f"{gemm_tuning.device_tag()}.json")
    return rec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    rec = run(parse_args(argv))
    print(f"{rec['tuned']} shapes tuned ({rec['timings']} candidates, {rec['tuning_s']:.1f} s) in {rec['total_s']:.1f} s")
    print(f"table: {rec['table']}")
    print(f"wrote {write_results('tune_gemm', [rec])}")
    return rec


if __name__ == "__main__":
    main()
