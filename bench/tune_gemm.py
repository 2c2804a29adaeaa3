"""Tune a model's FP8 GEMMs ahead of serving into a tuning table: serving_gpu's preset model and settings
through libs/kernels/tune_step.py (the workers' warm-up stage by stage inside the tune step, each stage timed).

    python -m bench.tune_gemm [--layers 4 --experts 16 --top-k 8] [--table-dir libs/kernels/tuning]
    python -m bench.tune_gemm --smoke --device cpu       # the tiny model: runs the stages, tunes nothing

The default folder is the one the project ships (read by every process on a device of the same name and
Triton version). `moemesh tune --model DIR` does the same for a checkpoint of one's own. Writes a record
`benchmark` "tune_gemm": seconds per stage, choices made, the table's path.
"""

from __future__ import annotations

import argparse
import tempfile
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
    ap.add_argument("--retune", action="store_true", help="time shapes the tables already answer, too")
    return ap.parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, Any]:
    from bench.serving_gpu import parse_args as serving_args
    from bench.serving_gpu import settings, write_model
    from libs.engine import Engine
    from libs.kernels.tune_step import tune_engine

    flags = ["--device", a.device, "--layers", str(a.layers), "--experts", str(a.experts)]
    flags += ["--top-k", str(a.top_k), "--concurrency", str(a.concurrency)] + (["--smoke"] if a.smoke else [])
    sa = serving_args(flags)
    s = settings(sa)
    kw = s.engine_kwargs()
    with tempfile.TemporaryDirectory(prefix="tune-gemm-") as tmp:
        model = write_model(sa, Path(tmp))
        engine = Engine.from_pretrained(model["dir"], device=a.device, dtype=s.dtype, **kw)
        tuned = tune_engine(
            engine, kw["max_prefill_tokens"], kw["max_num_seqs"], a.table_dir, retune=a.retune,
            log=lambda line: print(line, flush=True),
        )  # fmt: skip
    return {"benchmark": "tune_gemm", "model": model, **tuned}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    rec = run(parse_args(argv))
    print(
        f"{rec['tuned']} shapes tuned ({rec['timings']} candidates, {rec['tuning_s']:.1f} s) in {rec['total_s']:.1f} s"
    )
    print(f"table: {rec['table']}")
    print(f"wrote {write_results('tune_gemm', [rec])}")
    return rec


if __name__ == "__main__":
    main()
