#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side, for the `device` tool's lent H200:
#   bash bench/gpu_check.sh [quick]        (carry .whl with the FlashInfer wheels, see NOTES-decode.md)
# Each GPU test file runs in its own process with its own time limit, so one sticky CUDA fault (an
# illegal address poisons the whole process) cannot hide the others' results; only compact summaries
# go to $OUT (the device tool brings back a limited number of files).
set -u
export OUT=${OUT:-/tmp/gpu_check}  # write_results puts the new records here
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  pip install --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=/tmp/fi
fi
summary="$OUT/summary.txt"
: > "$summary"
for f in tests/libs/kernels/test_*.py tests/libs/engine/test_mla_forms.py tests/libs/engine/test_cuda_graph.py tests/libs/engine/test_attention_backends.py tests/libs/engine/test_fast_path.py; do
  log=$(timeout 240 python3 -m pytest -q -rf --tb=short --confcutdir=tests/libs -p no:cacheprovider "$f" 2>&1)
  line=$(echo "$log" | grep -E "^(FAILED|ERROR)|passed|failed|error" | tail -6 | tr '\n' ' ')
  echo "$f: ${line:-timed out or crashed}" | tee -a "$summary"
  case "$line" in *failed*|*error*|"") echo "$log" | grep -v -i warn | tail -60 > "$OUT/fail-$(basename "$f" .py).txt";; esac
done
[ "${1:-}" = quick ] && exit 0
timeout 300 python3 -m bench.decode_rank --batch 256,512 2>&1 | grep -E "^B=" | tee -a "$summary"
timeout 240 python3 -m bench.kernels --skip-mla > "$OUT/kernels.log" 2>&1
grep -E "masked-chosen|sm90-masked-128-128-8-4-4|choices" "$OUT/kernels.log" | cut -c1-160 | tee -a "$summary"
