#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a tuning campaign for every operator with Triton kernels.
# Without CUDA this is the CPU demo: tiny shapes, a few trials, every kernel on the Triton interpreter,
# timings labelled interpreter timings; the winners go to the default database (REWY_DB overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec rewy-tune --device auto --op all "$@"
fi
export TRITON_INTERPRET=1
exec rewy-tune --device cpu --op all --trials 4 "$@"
