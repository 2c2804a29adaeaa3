#!/usr/bin/env bash
# DeepEP for the GPU machine, in two halves (that machine has no internet):
#   bash scripts/build_deep_ep.sh fetch   # here, with PyPI: the source distributions into .gpu-pkgs/deep_ep/
#   bash scripts/build_deep_ep.sh build   # there (carry .gpu-pkgs): wheels built with nvcc + NVSHMEM from
#                                         # the nvidia-nvshmem-cu13 package, installed into $SITE (/tmp/site);
#                                         # log in $OUT/deep_ep_build.log, outcome in $OUT/deep_ep_build.json
# Then `PYTHONPATH=/tmp/site python3 scripts/check_deep_ep.py` runs the one-rank round trips (with
# LD_LIBRARY_PATH=.gpu-pkgs/deep_ep/sysroot/usr/lib/x86_64-linux-gnu and CPATH=.../usr/include for deep_jit).
#
# What PyPI has (read 2026-12-01): `deep-ep` 1.0.0, an sdist of DeepEP's first release (its V1 API: Buffer,
# get_dispatch_layout, dispatch/combine, low_latency_dispatch/combine), whose csrc/ lacks the headers its
# sources include (deep_ep.hpp, config.hpp, kernels/api.cuh, ...): the build stops at the first include.
# `deepinfer-ep` 2.5.0 is a complete sdist of DeepEP V2.5 (import name deep_ep too, NCCL instead of
# NVSHMEM, kernels JIT-compiled at run time, V1's Buffer API removed). `build` tries deep-ep first and,
# if it fails, deepinfer-ep, so one device call says what builds; libs/ep/dispatch/deepep.py speaks V1,
# deepep_v2.py V2 (make_dispatcher picks by what the installed deep_ep has).
# Neither builds on the H200 image (2026-12-01, bench/NOTES-ep.md): deep-ep 1.0.0 for its missing headers
# (PyPI has no other version; GitHub, where they are, is not reachable from the machines), deepinfer-ep
# because its README asks NCCL >= 2.32.3 and CUDA >= 13.1 (DeepJIT) while the image has torch's NCCL 2.28.9
# (nvidia-nccl-cu13, pinned by torch 2.11) and nvcc 13.0: its headers lack the GIN API it uses everywhere
# (ncclGinRequest_t, ncclGin_StrongVASignalAdd, NCCL_GIN_RESOURCE_SHARING_*: in dispatch and combine, not
# only Engram, so no define turns it off; 2.29.7's headers lack them too), and a newer libnccl (237 MB in
# the 2.29.7 wheel) cannot travel in a 64 MiB carry. So `build` checks first and says "unbuildable" with the
# reason instead of compiling: FORCE=1 compiles anyway; EP_NCCL_ROOT_DIR (include/, lib/) names another
# NCCL, as deepinfer-ep's own setup reads it.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.gpu-pkgs/deep_ep
# name, version, sha256 of the sdist: pinned so the carry is what was read here
SOURCES=(
  "deep-ep 1.0.0 d6894fadaec1406e7c4ababf06518d42edad7bc862c8aff137b9542b83f02090"
  "deepinfer-ep 2.5.0 14d5b32e77fc1609f95444136c19519606c0b3552648ef9a1f472dca99c983d2"
)

fetch() {
  mkdir -p "$dir"
  local entry
  for entry in "${SOURCES[@]}"; do
    # shellcheck disable=SC2086
    set -- $entry
    python3 - "$1" "$2" "$3" "$dir" <<'EOF'
import hashlib, json, sys, urllib.request
from pathlib import Path
name, version, sha, out = sys.argv[1:]
index = f"https://pypi.org/simple/{name}/"
req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
sdists = [f for f in files if f["filename"].endswith(f"-{version}.tar.gz")]
if not sdists:
    sys.exit(f"PyPI has no source distribution of {name} {version}: {[f['filename'] for f in files]}")
f = sdists[0]
data = urllib.request.urlopen(urllib.request.Request(urllib.parse.urljoin(index, f["url"])), timeout=120).read()
got = hashlib.sha256(data).hexdigest()
if got != sha:
    sys.exit(f"{f['filename']}: sha256 {got}, pinned {sha}")
(Path(out) / f["filename"]).write_bytes(data)
print(f"{f['filename']}: {len(data)} bytes, sha256 ok")
EOF
  done
  fetch_sysroot
  du -sh "$dir"
}

# deepinfer-ep's deep_jit includes elfutils/libdwfl.h (the H200 image has no libdw-dev: the first build
# stopped there); the Debian packages' headers and libraries go into $dir/sysroot, which `build` puts on
# CPATH / LIBRARY_PATH / LD_LIBRARY_PATH
DEBS=(libdw-dev libdw1 libelf-dev libelf1)
fetch_sysroot() {
  local debs="$dir/debs"
  rm -rf "$debs" "$dir/sysroot"
  mkdir -p "$debs" "$dir/sysroot"
  (cd "$debs" && apt-get download -q "${DEBS[@]}" 2>&1 | grep -v "unsandboxed") || { echo "apt-get download failed"; return 1; }
  local deb
  for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$dir/sysroot"; done
  rm -rf "$debs"
  [ -f "$dir/sysroot/usr/include/elfutils/libdwfl.h" ] || { echo "no elfutils/libdwfl.h in the sysroot"; return 1; }
  echo "sysroot: $(cd "$dir/sysroot" && find . -name 'libdw*.so*' -o -name libdwfl.h | tr '\n' ' ')"
}

use_sysroot() {  # the carried headers and libraries, where fetch put them
  local root
  root=$(cd "$dir/sysroot" 2>/dev/null && pwd) || return 0
  export CPATH="$root/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

nvshmem_dir() {  # the nvidia-nvshmem-cu13 package's root (include/, lib/)
  python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
}

nccl_version() {  # $1 NCCL root (include/nccl.h) -> "major.minor.patch", empty when unreadable
  awk '/^#define NCCL_(MAJOR|MINOR|PATCH) / { v[$2] = $3 }
       END { if (v["NCCL_MAJOR"] != "") print v["NCCL_MAJOR"] "." v["NCCL_MINOR"] "." v["NCCL_PATCH"] }' \
    "$1/include/nccl.h" 2>/dev/null
}

# why deepinfer-ep cannot build here (README: NCCL >= 2.32.3, CUDA >= 13.1), empty when it can
deepinfer_blocker() {
  local root ver cuda
  root=${EP_NCCL_ROOT_DIR:-$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)}
  ver=$(nccl_version "$root")
  cuda=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  echo "NCCL at ${root:-?}: ${ver:-unreadable}; nvcc ${cuda:-missing}" >> "$LOG"
  # shellcheck disable=SC2086
  set -- $(echo "${ver:-0.0.0}" | tr . " ")
  local why=""
  if [ $(($1 * 10000 + $2 * 100 + $3)) -lt 23203 ]; then
    why="NCCL ${ver:-unreadable} at ${root:-?} < 2.32.3 (GIN API: ncclGinRequest_t, ncclGin_StrongVASignalAdd)"
  fi
  if [ -z "$cuda" ] || [ "$(printf '%s\n13.1\n' "$cuda" | sort -V | head -1)" != 13.1 ]; then
    why="${why:+$why; }CUDA ${cuda:-none} < 13.1 (DeepJIT)"
  fi
  echo "$why"
}

build_one() {  # $1 sdist, $2 label; appends to the log, prints ok, failed or "unbuildable: why"
  local sdist=$1 label=$2 src missing="" why=""
  src=$(mktemp -d /tmp/deep_ep_src.XXXX)
  tar xzf "$sdist" -C "$src"
  src=$(ls -d "$src"/*/)
  echo "=== $label: $(basename "$sdist") ===" >> "$LOG"
  if [ -f "$src/setup.py" ] && grep -q "csrc/deep_ep.cpp" "$src/setup.py"; then
    missing=$(cd "$src/csrc" && grep -ho '#include "[^"]*"' deep_ep.cpp kernels/*.cu | sort -u | sed 's/#include "\(.*\)"/\1/' \
      | while read -r h; do [ -e "$h" ] || [ -e "kernels/$h" ] || echo "$h"; done | tr '\n' ' ')
    echo "headers the sources include that the sdist lacks: ${missing:-none}" >> "$LOG"
    [ -n "$missing" ] && why="the sdist lacks the headers its sources include: ${missing% }"
  fi
  case "$label" in deepinfer_ep-*) why=$(deepinfer_blocker) ;; esac
  if [ -n "$why" ] && [ "${FORCE:-0}" != 1 ]; then
    echo "not compiled (FORCE=1 compiles anyway): $why" >> "$LOG"
    echo "unbuildable: $why"
    return
  fi
  if (cd "$src" && timeout "${BUILD_TIMEOUT:-360}" python3 -m pip wheel -v --no-build-isolation --no-deps \
        -w "$WHEELS" .) >> "$LOG" 2>&1; then
    echo ok
  else
    echo failed
  fi
}

build() {
  OUT=${OUT:-/tmp/deep_ep_out}
  SITE=${SITE:-/tmp/site}
  LOG="$OUT/deep_ep_build.log"
  WHEELS=$(mktemp -d /tmp/deep_ep_wheels.XXXX)
  mkdir -p "$OUT" "$SITE"
  : > "$LOG"
  NVSHMEM_DIR=$(nvshmem_dir 2>>"$LOG") || { echo "nvidia-nvshmem-cu13 does not import" >> "$LOG"; NVSHMEM_DIR=; }
  export NVSHMEM_DIR TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
  use_sysroot
  {
    echo "nvcc: $(nvcc --version 2>&1 | tail -2 | tr '\n' ' ')"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "NVSHMEM_DIR=$NVSHMEM_DIR"; ls "$NVSHMEM_DIR/lib" 2>&1 | tr '\n' ' '; echo
    echo "CPATH=${CPATH:-} LIBRARY_PATH=${LIBRARY_PATH:-}"
  } >> "$LOG" 2>&1
  local results=() sdist label status start err built=""
  for sdist in "$dir"/deep_ep-*.tar.gz "$dir"/deepinfer_ep-*.tar.gz; do
    [ -f "$sdist" ] || { results+=("\"$(basename "$sdist")\": \"not fetched\""); continue; }
    label=$(basename "$sdist" .tar.gz)
    start=$(wc -l < "$LOG")
    status=$(build_one "$sdist" "$label")
    err=""
    if [ "${status%%:*}" = unbuildable ]; then
      err=$(echo "${status#unbuildable: }" | sed 's/\\/\\\\/g; s/"/\\"/g')
      status=unbuildable
    elif [ "$status" != ok ]; then  # the attempt's first error line, quoted for the note
      err=$(tail -n +"$((start + 1))" "$LOG" | grep -m1 -E "error:|fatal error|Error" | cut -c1-300 \
        | sed 's/\\/\\\\/g; s/"/\\"/g; s/\t/ /g')
    fi
    results+=("\"$label\": {\"status\": \"$status\", \"$([ "$status" = unbuildable ] && echo reason || echo first_error)\": \"$err\"}")
    if [ "$status" = ok ]; then built=$label; break; fi
  done
  if [ -n "$built" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl >> "$LOG" 2>&1 || built=""
  fi
  (IFS=,; echo "{${results[*]}, \"installed\": \"${built:-none}\", \"site\": \"$SITE\"}") | tee "$OUT/deep_ep_build.json"
}

case "${1:-}" in
  fetch) fetch ;;
  build) build ;;
  *) echo "usage: $0 fetch|build" >&2; exit 2 ;;
esac
