#!/usr/bin/env bash
# Install strata and its dependencies into the current Python environment.
#   scripts/install.sh          # runtime (+ server)
#   scripts/install.sh dev      # + test tools (pytest, transformers, ruff) and matplotlib
#   scripts/install.sh bench    # + matplotlib, for the benchmark suite's plot (python -m bench)
#   scripts/install.sh gpu      # + CuPy and kvikio (CUDA 13)
# On a host without an NVIDIA GPU it installs the CPU build of torch first, so that pip never
# pulls a multi-GB CUDA build; an already installed torch is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${STRATA_TORCH_VERSION:-2.13.0}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==${TORCH_VERSION}"
  else
    # CPU-only host: the CPU wheel, from a local wheel directory (pip's find-links) when there is
    # one, else from PyTorch's CPU index; never the default index's CUDA build.
    if "$PY" -m pip install -q --no-index --no-deps "torch==${TORCH_VERSION}" 2>/dev/null; then
      "$PY" -m pip install -q "torch==${TORCH_VERSION}"  # its dependencies; torch itself is satisfied
    else
      "$PY" -m pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
fi

extras=""
for arg in "$@"; do
  case "$arg" in
    dev|bench|gpu|gpu-cu12) extras="${extras:+$extras,}$arg" ;;
    *) echo "install.sh: unknown extra '$arg' (use dev, bench, gpu or gpu-cu12)" >&2; exit 2 ;;
  esac
done
"$PY" -m pip install -q -e ".${extras:+[$extras]}"
case ",$extras," in
  *,dev,*)  # the dashboard's browser test needs Chromium (from the OS packages); it skips without one
    bash scripts/install-browser.sh || echo "install.sh: no Chromium; the dashboard browser test will skip" >&2 ;;
esac
