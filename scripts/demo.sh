#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job. On a machine without CUDA this is the CPU demo:
# the correctness gate for all four operators, the Triton kernels on the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec rewy-tune verify --op all --backend auto --device cuda "$@"
fi
export TRITON_INTERPRET=1
exec rewy-tune verify --op all --backend auto --device cpu "$@"
