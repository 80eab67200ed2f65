#!/usr/bin/env bash
# One call on the H200 (device tool): install the carried wheels and this project, run the GPU tests,
# Python runs with -P so the checkout's rewy_tune/ folder does not shadow the installed namespace.
# the CUDA verify gate and the benchmark, leaving logs and JSON under $OUT.
#   usage: bash benchmarks/device_run.sh TESTS_SECONDS "OPS" "POLICIES" [pytest paths...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 REWY_TEST_NO_INTERPRET=1
rm -rf build ./*.egg-info  # a stale build/ from an earlier call would be installed instead of the source
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1 || exit 4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
tests_s=${1:-240}; ops=${2:-"deltanet gdn"}; policies=${3:-"R A"}; shift 3 || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
if [ "$tests_s" -gt 0 ]; then
  timeout "$tests_s" python3 -P -m pytest -q -m gpu --maxfail=3 --tb=short -p no:cacheprovider "${@:-tests}" > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests.log" | tail -25
fi
for op in $ops; do for pol in $policies; do
  python3 -P -m rewy_tune.cli.main bench --op "$op" --policy "$pol" --json "$OUT/bench-$op-$pol.json" \
    > "$OUT/bench-$op-$pol.log" 2>&1; echo "bench $op $pol rc=$?"
  grep -v "^measuring" "$OUT/bench-$op-$pol.log" | tail -16
done; done
