#!/usr/bin/env bash
# Create .venv (if missing) and install rewy-tune with its test extras into it.
# Torch: the CPU build on machines without an NVIDIA GPU. Override the spec with TORCH_SPEC,
# add an index with TORCH_INDEX_URL (e.g. the PyTorch CPU wheel index on a plain machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
fi
# Triton 3.6.0 is the version the interpreter path is tested with (the CPU torch build does not bring it).
python -m pip install -q "triton==3.6.0" "numpy<2.4"
python -m pip install -q -e ".[test]"
