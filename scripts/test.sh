#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Without CUDA, Triton kernels run on the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
