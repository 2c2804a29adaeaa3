#!/usr/bin/env bash
# Gather, on a machine with PyPI, the wheels a GPU machine without internet lacks, into .whl/ (git-ignored),
# for the device tool's `carry` (64 MiB a call). Python 3.12, manylinux x86_64.
#   bash scripts/gpu_wheels.sh flashinfer   # flashinfer-python (JIT sources it cannot use on Hopper pruned) + tvm-ffi
# On the GPU machine: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
# (bench/gpu_check.sh and bench/gpu_run.sh do that).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-flashinfer}
dir=.whl
mkdir -p "$dir"
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}
case "$what" in
  flashinfer)
    dl flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
    # FlashInfer JIT-compiles from sources shipped in the wheel; those of Blackwell-only and unused kernels
    # are dropped so the pair fits one carry beside the project (measured: 62 MB -> 33 MB).
    whl=$(ls "$dir"/flashinfer_python-*.whl)
    tmp=$(mktemp -d)
    (cd "$tmp" && python3 -m zipfile -e "$OLDPWD/$whl" . \
      && find . -path '*flashinfer/data/csrc/*' \( -name 'cake_*' -o -name 'kda*' -o -name 'gdn*' -o -name 'fused_moe*' \
           -o -name 'blackwell_*' -o -name 'alphamoe*' \) -prune -exec rm -rf {} + \
      && rm -f "$OLDPWD/$whl" && python3 -m zipfile -c "$OLDPWD/$whl" ./*)
    rm -rf "$tmp"
    ;;
  *) echo "usage: $0 flashinfer" >&2; exit 2 ;;
esac
du -sh "$dir"; ls -la "$dir"
