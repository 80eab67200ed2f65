#!/usr/bin/env bash
# One bounded call on the H200 (device tool): install the carried wheels (.whl) and this project, then run
# the steps named in STEPS, each under its own time limit. Everything comes back in $OUT/results.tgz plus
# the short logs (the device returns at most 8 files).
#   STEPS="tests bench" bash benchmarks/device_check.sh
# Steps: tests (GPU-marked pytest, TEST_JOBS processes (12 ran K = V = 256 out of GPU memory, session 47; 4 did
# not), TEST_K a pytest -k expression; the FLA-layer cases of tests/test_fla_patch_activations.py skip unless the
# flash-linear-attention wheel is carried too (see models below); REWY_TEST_GPU_SCHEDULE=FILE
# gates a candidate DeltaNet/GDN default instead of the built-in one, and TEST_CANDIDATE="deltanet A
# query_side_block_v=32" writes that file: the operator's default here with those fields set), bench (rewy-tune bench --op $BENCH_OPS --policy
# $BENCH_POLICY, compiled ahead in parallel), campaign (rewy-tune --device h200 $CAMPAIGN_ARGS into
# results/h200.db), sweep (benchmarks/profile_stages.py: schedule variants of every operator against FLA; SWEEP_ARGS
# extra options, e.g. "--profile default,NAME"; a cold host needs SWEEP_S >= 300 to compile ahead), enumerate
# (benchmarks/enumerate_space.py: every schedule of a small space timed once), ncu (hardware
# counters of one backward's local kernels, benchmarks/one_backward.py; NCU_FLA_KERNELS adds FLA's), models
# (benchmarks/model_check.py; needs FLA's model package carried too, which the image lacks (session 18):
# bash ../shared/tools/device-wheels.sh flash-linear-attention==0.6.0), combine (benchmarks/combine_bench.py: the
# segment-combine kernel at 1-3 stages, COMBINE_S seconds), scanbench (benchmarks/scan_bench.py: the reverse scan alone
# per chunk step against FLA's, SCANBENCH_S seconds, SCANBENCH_ARGS e.g. "--only deltanet,gdn --heads 16 32
# --no-combine"), timeline (benchmarks/chase_timeline.py once per "|"-separated
# argument list in TIMELINE_RUNS: each kernel's start and end in a replayed graph), script (python3 $SCRIPT_ARGS, SCRIPT_S
# seconds: a diagnostic of this checkout).
# BENCH_ARGS, SWEEP_ARGS, TEST_ARGS are split on spaces and quotes inside them are not removed: give each field its
# own --set (--set forward_scan.block_v=32 --set forward_scan.num_stages=3), not one quoted string (session 17).
# TCACHE_SAVE=1 returns Triton's compile cache (binaries and metadata) as $OUT/tcache.tgz.part-*; put them in .tcache/
# (ignored) and carry it: a later call on a cold host starts with every kernel compiled (same Triton, same sources).
# The archive is written after the steps: an outer `timeout` around this script must leave it time (session 24's
# wrapped a sweep at 15 s over SWEEP_S, which ended the archive half written).
# BG_STEPS run at the same time as STEPS, on GPU BG_GPU (default 1) of a two-GPU machine, e.g. the GPU tests beside
# a one-worker campaign on GPU 0. The background steps write under bg/ (OUT and results); BG_SWEEP_OPS gives them
# their own operator for a sweep (e.g. STEPS=sweep SWEEP_OPS=gdn BG_STEPS=sweep BG_SWEEP_OPS=deltanet).
# STEPS=none runs no step (e.g. with TCACHE_SAVE=1 alone: return the compile cache of the calls before on this host).
set -uo pipefail
# A misspelt step is refused before anything is installed, not found after the install has spent device time.
known_steps="none $(sed -n 's/^step_\([a-z]*\)() {.*/\1/p' "$0" | tr '\n' ' ')"
for s in ${STEPS:-tests bench} ${BG_STEPS:-}; do
  case " $known_steps" in *" $s "*) ;; *) echo "STEPS/BG_STEPS: unknown step '$s'; accepted: $known_steps"; exit 2 ;; esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 3
# PYTHONSAFEPATH: the checkout's rewy_tune/ folder must not shadow the installed namespace, in any
# process (pytest-xdist workers and trial workers included).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 REWY_TEST_NO_INTERPRET=1
rm -rf build ./*.egg-info  # a stale build/ from an earlier call would be installed instead of the source
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1 || exit 4
# Triton's compile cache from an earlier call (TCACHE_SAVE=1 below; carry .tcache): a cold host otherwise spends
# 200-250 s of a call compiling fla-core's autotuning configurations and our kernels again (session 22). Kept: the
# binaries and their metadata, which is all a cache hit reads (not fla-core's autotuning picks: each process that
# measures times its own, fla_baseline.autotune_here). The group files name absolute paths: rewritten here.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
if ls .tcache/tcache.tgz.part-* >/dev/null 2>&1; then
  mkdir -p "$TRITON_CACHE_DIR" && cat .tcache/tcache.tgz.part-* | tar xzf - -C "$TRITON_CACHE_DIR"
  old=$(cat "$TRITON_CACHE_DIR/.prefix" 2>/dev/null)
  if [ -n "$old" ] && [ "$old" != "$TRITON_CACHE_DIR" ]; then
    grep -rlF --include='__grp__*' "$old" "$TRITON_CACHE_DIR" | xargs -r sed -i "s#$old#$TRITON_CACHE_DIR#g"
  fi
  echo "triton cache: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) binaries carried in"
fi
# A host can keep /tmp from an earlier call (session 6 found session 5's bench files there): start RES empty unless
# KEEP_RESULTS=1 (e.g. a campaign continued with --resume, or promoted against the previous call's winners).
OUT=${OUT:-/tmp/out}; RES=/tmp/results
[ "${KEEP_RESULTS:-0}" = 1 ] || rm -rf "$RES"
mkdir -p "$OUT" "$RES"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee "$RES/gpu.txt"
python3 -c "import rewy_tune.measure as m; print(m.software_versions())" | tee -a "$RES/gpu.txt"

step_tests() {
  if [ -n "${TEST_CANDIDATE:-}" ]; then  # "OP POLICY FIELD=VALUE ...": that default with those fields, gated instead
    python3 -c 'import sys, torch; from rewy_tune.cli.bench import candidate_schedule as c
print(c(sys.argv[1], torch.cuda.get_device_capability()).to_json())' "$TEST_CANDIDATE" > "$RES/candidate.json" \
      || { echo "TEST_CANDIDATE: not a schedule, tests not run"; return; }
    export REWY_TEST_GPU_SCHEDULE="$RES/candidate.json"; echo "gating the candidate: $(cat "$RES/candidate.json")"
  fi
  REWY_TEST_REPORT="$RES/gpu-tests-report.txt" timeout "${TESTS_S:-220}" python3 -m pytest -q -m gpu \
    -n "${TEST_JOBS:-8}" --timeout 200 -rf --tb=short -p no:cacheprovider -p no:benchmark ${TEST_ARGS:-} \
    ${TEST_K:+-k "$TEST_K"} ${TEST_PATHS:-tests} > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " "$RES/gpu-tests-report.txt" | cut -c1-150
  grep -E "^E  " "$RES/gpu-tests-report.txt" | sort | uniq -c | sort -rn | head -15
}
step_bench() {  # BENCH_OPS: one operator or "all" per rewy-tune bench call; several run one after another
  # --json takes a file unless the directory exists: made first, or one operator and policy would write a file
  # named "bench" and the next operator overwrite it (session 15, calls 3-4)
  mkdir -p "$RES/bench"
  for op in ${BENCH_OPS:-all}; do
    timeout "${BENCH_S:-330}" python3 -m rewy_tune.cli.main bench --op "$op" \
      --policy "${BENCH_POLICY:-both}" ${BENCH_ARGS:-} --json "$RES/bench" >> "$OUT/bench.log" 2>&1
    echo "bench $op rc=$?"
  done
  grep -vE "^measuring" "$OUT/bench.log" | grep -vE "^\s*$" | tail -90
}
step_campaign() {
  timeout "${CAMPAIGN_S:-500}" python3 -m rewy_tune.cli.main --device h200 $CAMPAIGN_ARGS \
    --db "sqlite:///$RES/h200.db" --storage "$RES/h200.journal" > "$RES/campaign.log" 2>&1
  echo "campaign rc=$?"; tail -c 4000 "$RES/campaign.log"
}
step_sweep() {  # SWEEP_OPS: "all", one operator, or several run one after another (sweep-OP.log / .json each)
  for op in ${SWEEP_OPS:-all}; do
    timeout "${SWEEP_S:-300}" python3 benchmarks/profile_stages.py --op "$op" --jobs "${SWEEP_JOBS:-12}" \
      --shapes ${SWEEP_SHAPES:-1,8192,4 1,8192,16} ${SWEEP_VARIANTS:+--variants "$SWEEP_VARIANTS"} ${SWEEP_ARGS:-} \
      --json "$RES/sweep-$op.json" > "$OUT/sweep-$op.log" 2>&1
    echo "sweep $op rc=$?"; grep -vE "Warning|return \[o for o" "$OUT/sweep-$op.log" | tail -c 6000
  done
}
step_enumerate() {  # the exhaustive table for benchmarks/tpe_convergence.py
  timeout "${ENUM_S:-330}" python3 benchmarks/enumerate_space.py --op "${ENUM_OP:-gdn}" --shape "${ENUM_SHAPE:-1,8192,4}" \
    --jobs "${ENUM_JOBS:-14}" --out "$RES/enum-${ENUM_OP:-gdn}.json" > "$OUT/enumerate.log" 2>&1
  echo "enumerate rc=$?"; tail -20 "$OUT/enumerate.log"
}
step_ncu() {  # hardware counters of our local kernels (Firecracker runtime only: gVisor has none, H200.md)
  # NCU_FLA_KERNELS: also profile FLA's operator (one_backward.py --fla) at the same shape, into ncu-fla.txt.
  # NCU_EXTRA: more ncu options, e.g. "--section InstructionStats --section SchedulerStats".
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "ncu: not found"; return; }
  local side kern file flag
  for side in ours fla; do
    if [ "$side" = ours ]; then kern=${NCU_KERNELS:-rewy_bwd_kernel_(dv_local_vector|consumer_vector)}; file=ncu.txt; flag=
    else kern=${NCU_FLA_KERNELS:-}; file=ncu-fla.txt; flag=--fla; [ -n "$kern" ] || continue; fi
    # NCU_SOURCE=1: also keep the report and write its per-instruction page (SASS with warp-stall samples) as
    # ncu-source[-fla].csv; the addresses match a CPU compile's SASS (compile_times.py, SASS_DUMP) of the same kernel.
    local rep=()
    [ "${NCU_SOURCE:-0}" = 1 ] && rep=(--section SourceCounters -o "$RES/${file%.txt}" -f)
    timeout "${NCU_S:-300}" "$ncu" --clock-control none --profile-from-start off --target-processes all -k "regex:$kern" -c "${NCU_COUNT:-4}" \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      "${rep[@]}" python3 benchmarks/one_backward.py --op "${NCU_OP:-kda}" --policy "${NCU_POLICY:-R}" $flag \
      --shape "${NCU_SHAPE:-1,8192,16}" --reps 2 > "$RES/$file" 2>&1
    echo "ncu $side rc=$?"
    if [ "${NCU_SOURCE:-0}" = 1 ]; then  # the report's text pages, as the run without -o would have printed them
      "$ncu" -i "$RES/${file%.txt}.ncu-rep" --page details >> "$RES/$file" 2>&1
      "$ncu" -i "$RES/${file%.txt}.ncu-rep" --page source --csv --print-source sass > "$RES/${file%.txt}-source.csv" 2>&1
      echo "ncu source page rc=$? ($(wc -l < "$RES/${file%.txt}-source.csv") lines)"
    fi
    grep -E "^  [a-z_]+|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Local Memory|==ERR" "$RES/$file" | head -40
    # stall reasons (cycles per issued instruction), the largest first, per kernel launch
    awk '/^  [a-z_]+/ {k=$1} /issue_stalled_.*per_issue_active/ {n=$1; sub(/smsp__average_warps_issue_stalled_/,"",n);
      sub(/_per_issue_active.ratio/,"",n); if ($NF+0 > 0.3) print k, n, $NF}' "$RES/$file" | sort -k1,1 -k3,3nr | head -40
  done
}
step_combine() {  # the segment-combine kernel at 1-3 stages (benchmarks/combine_bench.py, scan.COMBINE_CARRY_STAGES)
  timeout "${COMBINE_S:-150}" python3 benchmarks/combine_bench.py --json "$RES/combine.json" > "$OUT/combine.log" 2>&1
  echo "combine rc=$?"; grep -vE "Warning|warn" "$OUT/combine.log" | tail -12
}
step_scanbench() {  # the reverse scan alone per chunk step, against FLA's (benchmarks/scan_bench.py)
  # shellcheck disable=SC2086
  timeout "${SCANBENCH_S:-150}" python3 benchmarks/scan_bench.py ${SCANBENCH_ARGS:-} --json "$RES/scan_bench.json" \
    > "$OUT/scan_bench.log" 2>&1
  echo "scanbench rc=$?"; grep -vE "Warning|warn|return \[o for o" "$OUT/scan_bench.log" | tail -45
}
step_timeline() {  # kernel start/end in a replayed graph (benchmarks/chase_timeline.py); TIMELINE_RUNS: its
  # argument lists, separated by "|" (e.g. "--shape 1,2048,16 | --shape 1,2048,16 --set dq_stage=separate")
  local IFS='|' run
  for run in ${TIMELINE_RUNS:---op deltanet --policy A --shape 1,2048,16}; do
    IFS=' '; echo "== timeline $run"
    # shellcheck disable=SC2086
    timeout "${TIMELINE_S:-120}" python3 benchmarks/chase_timeline.py $run 2>&1 \
      | grep -vE "Warning|warn|return \[o for o"
  done
}
step_script() {  # one more python script of this checkout: SCRIPT_ARGS its path and arguments, SCRIPT_S seconds
  # shellcheck disable=SC2086
  timeout "${SCRIPT_S:-120}" python3 $SCRIPT_ARGS > "$OUT/script.log" 2>&1
  echo "script rc=$?"; grep -vE "Warning|warn|return \[o for o" "$OUT/script.log" | tail -c 5000
}
step_models() {
  timeout "${MODELS_S:-240}" python3 benchmarks/model_check.py ${MODELS_ARGS:-} --json "$RES/models.json" \
    > "$OUT/models.log" 2>&1
  echo "models rc=$?"; tail -40 "$OUT/models.log"
}
bg=
if [ -n "${BG_STEPS:-}" ]; then
  ( export CUDA_VISIBLE_DEVICES="${BG_GPU:-1}" SWEEP_OPS="${BG_SWEEP_OPS:-${SWEEP_OPS:-all}}"
    export OUT="$OUT/bg" RES="$RES/bg"; mkdir -p "$OUT" "$RES"
    for s in $BG_STEPS; do [ "$s" = none ] || "step_$s"; done ) > "$OUT/background.log" 2>&1 &
  bg=$!
fi
for s in ${STEPS:-tests bench}; do [ "$s" = none ] || "step_$s"; done
if [ -n "$bg" ]; then wait "$bg"; echo "--- background steps (GPU ${BG_GPU:-1}): $BG_STEPS"; cat "$OUT/background.log"; fi
tar czf "$OUT/results.tgz" -C "$RES" .
if [ "${TCACHE_SAVE:-0}" = 1 ]; then  # $OUT/tcache.tgz.part-*: back here, then `mkdir -p .tcache; cp FILES_AT/tcache* .tcache/`
  echo "$TRITON_CACHE_DIR" > "$TRITON_CACHE_DIR/.prefix"
  (cd "$TRITON_CACHE_DIR" && find . \( -name '*.cubin' -o -name '*.json' -o -name .prefix \) ! -name '*.autotune.json' -print0 \
    | tar czf - --null -T - | split -b 15m - "$OUT/tcache.tgz.part-")
  ls -la "$OUT"/tcache.tgz.part-* | awk '{print "triton cache out:", $5, $9}'
fi
