#!/usr/bin/env bash
# The session's last H200 call, bounded to ~7 minutes: fp32-gate GPU tests, the benchmark with the default
# schedule (GDN R, DeltaNet R, GDN A), and a short real campaign whose database comes back for the dashboard.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 REWY_TEST_NO_INTERPRET=1
rm -rf build ./*.egg-info
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1 || exit 4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { python3 -P -m rewy_tune.cli.main "$@"; }
bench() { timeout 95 python3 -P -m rewy_tune.cli.main bench --op "$1" --policy "$2" --json "$OUT/bench-$1-$2.json" \
            > "$OUT/bench-$1-$2.log" 2>&1; echo "bench $1 $2 rc=$?"; grep -E "^│|geometric" "$OUT/bench-$1-$2.log"; }
bench gdn R
timeout 100 python3 -P -m pytest -q -m gpu -p no:cacheprovider --tb=line -k "fp32_gate or bitwise or graph_replay" \
  tests/kernels/test_triton_scalar.py tests/kernels/test_triton_vector.py > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|xfail|^FAILED|Error" "$OUT/gpu-tests.log" | tail -12
timeout 100 python3 -P -m rewy_tune.cli.main --device h200 --op gdn --policy R --shapes 1,2048,4 1,8192,16 \
  --trials 8 --time-budget 80s --db "sqlite:///$OUT/h200.db" --storage "$OUT/h200.journal" > "$OUT/campaign.log" 2>&1
echo "campaign rc=$?"; tail -c 2500 "$OUT/campaign.log"
bench deltanet R
