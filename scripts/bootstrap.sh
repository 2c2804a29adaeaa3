#!/usr/bin/env bash
# Create .venv (if missing) and install what moemesh needs into it; quick no-op when already up to date.
# torch is pinned to the CPU build that lies on local disk (a bare `torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Mooncake's non-cuda wheel loads libibverbs and libnuma at run time; a fresh Debian machine may lack them.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || ! ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1'; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
    $SUDO apt-get install -y -qq libibverbs1 libnuma1 >/dev/null 2>&1 \
      || { $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq libibverbs1 libnuma1 >/dev/null; }
  fi
fi
stamp=.venv/.moemesh-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev,mooncake]'
echo "$want" > "$stamp"
