#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side, for the `device` tool's lent H200:
#   bash bench/gpu_check.sh [quick|wave|fp8|prefill|mla|gemm]   (carry .whl: `bash scripts/gpu_wheels.sh flashinfer`)
#   PREFILL_BUDGETS=4096,16384 PREFILL_PROFILE=4096 bash bench/gpu_check.sh prefill   (prefill_rank, a profiled
#   forward, the GPU tests of what prefill runs); PREFILL_BASELINE=.baseline runs prefill_rank on that build first
#   (`bash scripts/baseline_tree.sh REV`, carry [".whl", ".baseline"]); PREFILL_ATTN=triton: without FlashInfer
#   FP8_EXTRA="fp8_e4m3:512 fp8_e4m3:256:triton" bash bench/gpu_check.sh fp8   (further decode_rank runs,
#   kv_cache_dtype:batch[:attention backend, default flashinfer]; triton decodes the FP8 cache's "token" rows)
#   MLA_RUNS="auto:flashinfer:auto fp8_e4m3:auto:auto" MLA_KERNEL_ARGS=--skip-flashinfer-fp8 bash bench/gpu_check.sh mla
#   (the FP8-row MLA decode kernels and the Engine's decode with each, MOEMESH_MLA_FP8=seesaw the warp-specialized
#   schedule; MLA_ACCURACY=1 adds the accuracy run)
#   FP8_TRITON=engine bash bench/gpu_check.sh fp8   (the Triton FP8 kernel only as the Engine runs it, no tile
#   sweep; none: FlashInfer's decodes only) beside FlashInfer's bf16 and FP8 decodes, then the Engine, then the
#   FP8 cache's accuracy on a random V3-width checkpoint with each row layout (bench.kv_fp8_accuracy)
# Each GPU test file runs in its own process with its own time limit, so one sticky CUDA fault (an
# illegal address poisons the whole process) cannot hide the others' results; only compact summaries
# go to $OUT (the device tool brings back a limited number of files).
set -u
export OUT=${OUT:-/tmp/gpu_check}  # write_results puts the new records here
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # its own folder: gpu_mesh.sh's /tmp/site holds a transformers without its models (a warm machine keeps it)
  pip install --no-index --no-deps --target /tmp/site-check .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site-check${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=/tmp/fi
fi
summary="$OUT/summary.txt"
: > "$summary"
# budgeted_tests MIN FILE...: each pytest target in its own process, limited to what is left of BUDGET (default
# 560 s: one device call) since t0; skipped when under MIN seconds are left. Its log goes to $OUT/log-<name>.txt.
budgeted_tests() {
  local min=$1 f left log name
  shift
  for f in "$@"; do
    left=$(( ${BUDGET:-560} - ($(date +%s) - t0) ))
    [ "$left" -lt "$min" ] && { echo "$f: not run ($left s left)" | tee -a "$summary"; continue; }
    log=$(timeout "$left" python3 -m pytest -q -rf --tb=short --confcutdir=tests/libs -p no:cacheprovider "$f" 2>&1)
    echo "$f: $(echo "$log" | grep -E "^(FAILED|ERROR)|passed|failed|error" | tail -6 | tr '\n' ' ')" | tee -a "$summary"
    name=$(basename "${f%%::*}" .py); [ "$f" != "${f%%::*}" ] && name="$name-${f##*::}"
    echo "$log" | grep -v -i warn | tail -60 > "$OUT/log-$name.txt"
  done
}
# on_baseline DIR PATTERN CMD...: CMD in a baseline build (scripts/baseline_tree.sh) with its records under
# $OUT/baseline; the lines matching PATTERN go to the summary, marked with the build's revision
on_baseline() {
  local dir=$1 pattern=$2
  shift 2
  (cd "$dir" && OUT="$OUT/baseline" && mkdir -p "$OUT" && export OUT && "$@" 2>&1 | grep -E "$pattern" \
    | sed "s/^/baseline $(cat REV 2>/dev/null): /" | tee -a "$summary")
}
if [ "${1:-}" = fp8 ]; then  # the FP8 KV cache: the MLA kernels over FP8 rows beside FlashInfer's bf16 one, the
  # Engine (FlashInfer's FP8 decode over "tensor" rows), then the GPU tests with what is left of BUDGET
  # (default 560 s: one device call), measurements first
  t0=$(date +%s)
  triton_fp8=${FP8_TRITON:-sweep}
  [ -n "${FP8_FAST:-}" ] && triton_fp8=none  # the older name of FP8_TRITON=none
  timeout 200 python3 -m bench.kernels --mla-fp8-only --quick --triton-fp8 "$triton_fp8" > "$OUT/kernels_fp8.log" 2>&1
  grep -E "^mla fp8|flashinfer|triton-bf16|failed|Error" "$OUT/kernels_fp8.log" | cut -c1-220 | tee -a "$summary"
  for run in auto:256 fp8_e4m3:256 ${FP8_EXTRA:-}; do
    IFS=: read -r dtype batch attn <<< "$run"
    timeout 150 python3 -m bench.decode_rank --batch "$batch" --attn "${attn:-flashinfer}" --kv-cache-dtype "$dtype" \
      2>&1 | grep -E "^B=|Error|error" | sed "s/^/$dtype ${attn:-flashinfer} /" | tee -a "$summary"
  done
  # accuracy against the bf16 cache on a random V3-width checkpoint (written once), with each FP8 row layout
  # (the writer `moemesh tiny-model --preset v3-width` runs, called directly: the CLI's parser imports the bus,
  # aiohttp, OpenTelemetry and prometheus-client, which the GPU image lacks)
  [ -f /tmp/v3-width/config.json ] || timeout 120 python3 -c "from libs.engine.preset_model import write_preset_model
print('wrote', write_preset_model('/tmp/v3-width', 'v3-width', overwrite=True))" 2>&1 | tail -1 | tee -a "$summary"
  for backend in auto flashinfer; do
    timeout 150 python3 -m bench.kv_fp8_accuracy --model /tmp/v3-width --device cuda --attention-backend "$backend" \
      2>&1 | grep -E "rel err|Error" | tee -a "$summary"
  done
  budgeted_tests 40 tests/libs/engine/test_cuda_graph.py::test_flashinfer_backend_decodes_fp8_rows_as_the_reference \
    tests/libs/engine/test_cuda_graph.py::test_flashinfer_fp8_decode_graph_replay_equals_eager_over_tensor_rows \
    tests/libs/kernels/test_kv_fp8_write.py tests/libs/kernels/test_mla_decode_fp8.py tests/libs/engine/test_kv_fp8.py
  exit 0
fi
if [ "${1:-}" = mla ]; then  # the FP8-row MLA decode: the Gluon SM90 kernel's GPU tests, the kernels beside
  # FlashInfer's bf16 one in one run (FP8_TRITON: the Triton FP8 kernel's sweep, engine (default) or none), then
  # the Engine's decode over FP8 rows with each kernel (MOEMESH_MLA_FP8=triton: the Triton one) beside bf16 rows;
  # DECODE_BASELINE runs the FP8 decode on that build too (as PREFILL_BASELINE), then the Triton kernels' tests
  t0=$(date +%s)
  budgeted_tests 30 tests/libs/kernels/test_mla_decode_fp8_sm90.py \
    tests/libs/engine/test_cuda_graph.py::test_sm90_fp8_decode_graph_replay_equals_eager
  timeout 200 python3 -m bench.kernels --mla-fp8-only --quick --triton-fp8 "${FP8_TRITON:-engine}" ${MLA_KERNEL_ARGS:-} \
    > "$OUT/kernels_fp8.log" 2>&1
  grep -E "^mla fp8|flashinfer|triton|gluon|failed|Error" "$OUT/kernels_fp8.log" | cut -c1-220 | tee -a "$summary"
  if [ -n "${DECODE_BASELINE:-}" ]; then
    on_baseline "$DECODE_BASELINE" "^B=|Error" timeout 100 python3 -m bench.decode_rank --batch 256 --attn triton \
      --kv-cache-dtype fp8_e4m3
  fi
  for run in ${MLA_RUNS:-auto:flashinfer:auto fp8_e4m3:auto:auto fp8_e4m3:auto:seesaw fp8_e4m3:auto:triton}; do  # dtype:backend:FP8 kernel ("auto"
    # with FP8 keeps "token" rows; "flashinfer" named would give FlashInfer's own FP8 decode "tensor" rows)
    IFS=: read -r dtype attn kernel <<< "$run"
    MOEMESH_MLA_FP8=$kernel timeout 100 python3 -m bench.decode_rank --batch 256 --attn "$attn" \
      --kv-cache-dtype "$dtype" 2>&1 | grep -E "^B=|Error" | sed "s/^/MOEMESH_MLA_FP8=$kernel /" | tee -a "$summary"
  done
  if [ -n "${MLA_ACCURACY:-}" ]; then  # the Engine's FP8 cache (this kernel on SM90) against bf16, V3-width model
    [ -f /tmp/v3-width/config.json ] || timeout 120 python3 -c "from libs.engine.preset_model import write_preset_model
print('wrote', write_preset_model('/tmp/v3-width', 'v3-width', overwrite=True))" 2>&1 | tail -1 | tee -a "$summary"
    timeout 150 python3 -m bench.kv_fp8_accuracy --model /tmp/v3-width --device cuda --attention-backend auto \
      2>&1 | grep -E "rel err|agree|Error" | tee -a "$summary"
  fi
  budgeted_tests 30 tests/libs/kernels/test_mla_decode_fp8.py tests/libs/kernels/test_mla_decode.py
  exit 0
fi
if [ "${1:-}" = gemm ]; then  # the FP8 GEMMs: the persistent warp-specialized kernel's GPU tests, then decode's
  # grouped GEMM shapes (every Gluon config, the warp-specialized ones among them, beside what the tuner chooses)
  # and prefill's 4k-token shapes the same way; each variant's rows are checked against the reference as timed
  t0=$(date +%s)
  budgeted_tests 30 tests/libs/kernels/test_fp8_gemm_sm90_ws.py
  timeout 200 python3 -m bench.kernels --skip-mla > "$OUT/kernels.log" 2>&1
  grep -E "masked-chosen|sm90-masked-128-128-8-4-4|sm90ws-|Error" "$OUT/kernels.log" | cut -c1-160 | tee -a "$summary"
  timeout 200 python3 -m bench.kernels --prefill-gemms > "$OUT/prefill_gemms.log" 2>&1
  grep -E "sm90-128-128-8-4-4 group_m=8|sm90ws-|chosen|Error" "$OUT/prefill_gemms.log" | cut -c1-160 | tee -a "$summary"
  exit 0
fi
if [ "${1:-}" = prefill ]; then  # prefill through the Engine (bench.prefill_rank, one forward profiled), then the
  # GPU tests of what it runs: the grouped GEMMs, the MoE's no-sync layout, the prefill attention backends
  t0=$(date +%s)
  if [ -n "${PREFILL_BASELINE:-}" ]; then  # the same benchmark on a baseline build first (scripts/baseline_tree.sh)
    on_baseline "$PREFILL_BASELINE" "^budget|one forward|Error" timeout 240 python3 -m bench.prefill_rank \
      --budgets "${PREFILL_BUDGETS:-4096,16384}" --attn "${PREFILL_ATTN:-flashinfer}"
  fi
  timeout 240 python3 -m bench.prefill_rank --budgets "${PREFILL_BUDGETS:-4096,16384}" --attn "${PREFILL_ATTN:-flashinfer}" \
    --profile "${PREFILL_PROFILE:-4096}" 2>&1 | grep -E "^budget|one forward|Error" | tee -a "$summary"
  budgeted_tests 30 tests/libs/kernels/test_mla_prefill.py tests/libs/kernels/test_fp8_gemm_sm90.py \
    tests/libs/kernels/test_fp8_engine_gpu.py \
    tests/libs/engine/test_cuda_graph.py::test_prefill_backend_matches_expanded_reference_on_gpu
  exit 0
fi
# `wave`: only the files of the latest work not yet run on a GPU (EP dispatch, TBO, EPLB, MTP graphs), so one
# call can cover them beside a benchmark; otherwise every GPU test file (several calls' worth with cold JIT).
case "${1:-}" in
  wave) files="tests/libs/ep/test_fixed_dispatch_gpu.py tests/libs/engine/test_two_batch_overlap.py
    tests/libs/ep/test_rebalance.py tests/libs/engine/test_spec_graphs.py tests/libs/engine/test_mtp_fast_path.py
    tests/libs/ep/test_deepep.py";;
  *) files="tests/libs/kernels/test_*.py tests/libs/engine/test_mla_forms.py tests/libs/engine/test_cuda_graph.py
    tests/libs/engine/test_attention_backends.py tests/libs/engine/test_fast_path.py
    tests/libs/engine/test_decode_pipeline.py tests/libs/engine/test_spec_graphs.py
    tests/libs/engine/test_two_batch_overlap.py tests/libs/ep/test_fixed_dispatch_gpu.py tests/libs/ep/test_rebalance.py";;
esac
for f in $files; do
  log=$(timeout 240 python3 -m pytest -q -rf --tb=short --confcutdir=tests/libs -p no:cacheprovider "$f" 2>&1)
  line=$(echo "$log" | grep -E "^(FAILED|ERROR)|passed|failed|error" | tail -6 | tr '\n' ' ')
  echo "$f: ${line:-timed out or crashed}" | tee -a "$summary"
  case "$line" in *failed*|*error*|"") echo "$log" | grep -v -i warn | tail -60 > "$OUT/fail-$(basename "$f" .py).txt";; esac
done
case "${1:-}" in quick|wave) exit 0;; esac
for batch in 256 512; do  # each in its own process: B=512's bf16 pool (72.9 GiB) does not fit beside the
  # weights on an 80 GB card, and its out-of-memory error must not take B=256's line with it
  timeout 200 python3 -m bench.decode_rank --batch "$batch" 2>&1 | grep -E "^B=|OutOfMemoryError" | cut -c1-160 \
    | tee -a "$summary"
done
timeout 240 python3 -m bench.kernels --skip-mla > "$OUT/kernels.log" 2>&1
grep -E "masked-chosen|sm90-masked-128-128-8-4-4|choices" "$OUT/kernels.log" | cut -c1-160 | tee -a "$summary"
