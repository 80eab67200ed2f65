#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Without CUDA, Triton kernels run on the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The checkout's top-level folders (kernels/, db/, cli/, ...) must not shadow installed packages: `python -m` and
# `python -c` put the working directory first on sys.path, where transformers >= 5.25 then finds our kernels/ as
# Hugging Face's `kernels` package and fails to import fla's layers. Safe-path Python (also in the tests'
# subprocesses, which inherit it) imports rewy_tune as installed, as on the GPU machine (benchmarks/device_check.sh).
export PYTHONSAFEPATH=1
exec python -m pytest -q "$@"
