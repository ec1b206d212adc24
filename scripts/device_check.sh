#!/usr/bin/env bash
# The one GPU run, at most 8 minutes (DEVICE_CHECK_BUDGET_S, default 480 s). A second full run does NOT fit the
# same 15-minute lease: the machine takes 1-2 minutes to start and this run 6-8, so after a first run there is
# time for the failed steps alone (`--only`), not for the whole check again. Each step has its own time limit
# (`timeout`); the limits add up to less than the budget (the plan is printed first and the check refuses to
# start when they do not fit), so a working GPU never has a step cut or skipped for time. The table says PASS /
# FAIL / TIMEOUT / SKIP, seconds, Triton compiles and exit status per step; the script exits non-zero unless
# every step it ran passed. Everything (each step's log, the JSON results, the table as text and summary.json)
# goes into ONE archive, $OUT/device_check.tar.gz ($OUT: the device tool's folder; results/device when unset),
# because only a few files come back from the GPU machine; it is rewritten after every step, so a run cut short
# still brings back what it did. Nothing is read from outside the repository: test models are written into a
# scratch folder, and the engine benchmark's ShareGPT lengths come from tests/data.
#
# Versions: the machine's own python3, torch and Triton (printed beside the pinned torch==2.13.0 and
# triton==3.7.1); nothing is installed (no network there). `make device-versions` runs the CPU side of the
# tests here with the versions of the GPU image (docs/gpu.md). Without a CUDA device it fails at once and
# says so.
#
# Steps, most valuable first, so that whatever cuts a run short loses the least. A step's limit is its start-up
# (imports, engines, runs) plus its Triton compiles at DC_COMPILE_S (2 s) each on the empty cache: kernels' 32
# were counted by recording the launches of its tests (scripts/triton_registers.py --count-kernel-tests),
# cuda_tests' ~65 (6 dtype x head dim x block size configurations x ~11 decode table widths and split counts),
# bench_gpu's ~8 and bench_attention's ~4 (OPT-13B's float16, head dim 128: mostly in the cache after kernels)
# are estimates; the first GPU run's table gives the real counts, to size them again. On this machine's two
# busy cores one compile for sm_90 takes 0.1-2.4 s (prefill the longest); the GPU machine adds the load.
#   step             what                                                              start-up + compiles = limit
#   env              versions, the GPU (scripts/device_env.py)                                     20 +  0 =  20 s
#   kernels          the compiled Triton kernels against the reference (tests/test_triton_kernels.py
#                    -m cuda, with --durations; pytest-xdist -n 6 when the machine has it)         20 + 32 =  84 s
#   bench_gpu        OPT-13B stage, float16: decode at batch 1 and 32 vs the HBM floor (graphs and
#                    eager, per backend, each with its own graph buckets), prefill vs GEMM, swaps
#                    vs one pinned memcpy, sampling on the device                                  50 +  8 =  66 s
#   bench_attention  Triton vs torch attention at OPT-13B's shape, float16; fails past tolerance   20 +  4 =  28 s
#   cuda_tests       every other `cuda` test (engine on CUDA vs transformers and vs CPU, float16 /
#                    bfloat16, graphs vs eager per backend, the device sampler, penalties, the
#                    host tier), serially (one test sizes its KV cache from 90% of the GPU)        35 + 65 = 165 s
#   control_plane    a decode step's wall time vs the executor's compute (sync / async output /
#                    async scheduling), opt-125m shape, batch 32 and 256 (writes the model first)  40 +  0 =  40 s
#   bench_engine     the engine vs transformers' generate, opt-125m shape, float16, --quick        35 +  0 =  35 s
#   reference        the model and attention reference tests on this machine's torch, on CPU (the
#                    CPU decode kernel's compiled cases left out: they build with g++, for CPU speed) 25 +  0 = 25 s
#                                                                  limits 463 s + DC_RESERVE_S 10 s = 473 s <= 480 s
#
#   bash scripts/device_check.sh                              # PYTHON=... to use another interpreter than python3
#   bash scripts/device_check.sh --only cuda_tests,reference  # env, then only these steps (rerun what failed)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_check_steps.sh

STEPS=(env kernels bench_gpu bench_attention cuda_tests control_plane bench_engine reference)
declare -A START_S=([env]=20 [kernels]=20 [bench_gpu]=50 [bench_attention]=20 [cuda_tests]=35 [control_plane]=40
  [bench_engine]=35 [reference]=25)
declare -A COMPILES=([env]=0 [kernels]=32 [bench_gpu]=8 [bench_attention]=4 [cuda_tests]=65 [control_plane]=0
  [bench_engine]=0 [reference]=0)
COMPILE_S=${DC_COMPILE_S:-2}

ONLY=""
while [ $# -gt 0 ]; do
  case $1 in
    --only) ONLY=${2:-}; shift 2 ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    *) echo "usage: bash scripts/device_check.sh [--only STEP,...]  (steps: ${STEPS[*]})" >&2; exit 2 ;;
  esac
done
declare -A SELECTED=([env]=1)
for name in ${ONLY//,/ }; do
  if [ -z "${START_S[$name]+x}" ]; then
    echo "device_check: unknown step '$name' in --only (steps: ${STEPS[*]})" >&2
    exit 2
  fi
  SELECTED[$name]=1
done

OUT=${OUT:-results/device}
PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-480}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastserve-device-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
RES=$WORK/device_check  # what the archive holds; models and the Triton cache stay beside it, outside the archive
MODEL=$WORK/models/opt-125m-random  # written by control_plane (or bench_engine when run alone)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export FASTSERVE_DEFAULT_MODEL=$WORK/models/tiny-opt  # never built: the tests build their own models
export FASTSERVE_CPU_KERNEL=0  # the CPU decode kernel's g++ build (~20 s) is for CPU speed, not this check
export TRITON_CACHE_DIR=$WORK/triton_cache  # empty: every compile counted in the table
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --durations=0)

limit_of() {  # STEP: its start-up plus its compiles
  echo $((START_S[$1] + COMPILES[$1] * COMPILE_S))
}

wanted() {  # STEP: whether this run runs it (every step, or env and the --only ones)
  [ -z "$ONLY" ] || [ -n "${SELECTED[$1]+x}" ]
}

step() {  # STEP CMD [ARG...]: run it under its planned limit, if this run wants it
  local name=$1
  shift
  wanted "$name" || return 0
  dc_step "$name" "$(limit_of "$name")" "$@"
}

planned=0
echo "[device_check] plan: step, start-up s + Triton compiles x $COMPILE_S s = limit"
for name in "${STEPS[@]}"; do
  wanted "$name" || continue
  planned=$((planned + $(limit_of "$name")))
  printf '[device_check]   %-16s %4s + %3s x %s = %4s s\n' "$name" "${START_S[$name]}" "${COMPILES[$name]}" \
    "$COMPILE_S" "$(limit_of "$name")"
done
echo "[device_check] limits add up to $planned s + ${DC_RESERVE_S} s for the archive, of the $BUDGET s budget"
if [ $((planned + DC_RESERVE_S)) -gt "$BUDGET" ]; then
  echo "device_check: the steps' limits ($planned s + ${DC_RESERVE_S} s) do not fit the $BUDGET s budget" >&2
  exit 2
fi

dc_begin "$RES" "$BUDGET" "$OUT/device_check.tar.gz"
echo "[device_check] results into $OUT/device_check.tar.gz (rewritten after every step); budget $BUDGET s"
step env "$PY" -m scripts.device_env --json "$RES/env.json" ||
  dc_stop "no usable CUDA device (env.log says why)"

XDIST=()
if [ -z "$DC_STOP_REASON" ] && wanted kernels && "$PY" -c "import xdist" 2>/dev/null; then
  XDIST=(-n 6)  # the 6 (dtype, head dim) cases compile in parallel
fi
step kernels "${PYTEST[@]}" "${XDIST[@]}" -m cuda tests/test_triton_kernels.py

step bench_gpu "$PY" -m scripts.benchmarks.gpu --device cuda --json "$RES/bench_gpu.json"

step bench_attention "$PY" -m scripts.benchmarks.attention --shape opt-13b --dtype float16 --json "$RES/bench_attention.json"

mapfile -t CUDA_FILES < <(grep -l "pytest.mark.cuda" tests/test_*.py | grep -v "tests/test_triton_kernels.py")
step cuda_tests "${PYTEST[@]}" -m cuda "${CUDA_FILES[@]}"

# shellcheck disable=SC2016  # $1.. are bash -c's own arguments
step control_plane bash -c '"$1" -m scripts.benchmarks.engine --model "$2" --model-only &&
  exec "$1" -m scripts.benchmarks.control_plane --device cuda --model "$2" --batch 32,256 --steps 20 --repeats 1' \
  control_plane "$PY" "$MODEL"

step bench_engine "$PY" -m scripts.benchmarks.engine --quick --device cuda --dtype float16 --model "$MODEL" \
  --lengths tests/data/sharegpt_fig15_trace.json --json "$RES/bench_engine.json"

# On CPU whatever the machine has (tests/test_model_reference.py pins its engine to the CPU); the CPU decode
# kernel's compiled cases need its g++ build, which this check turns off (FASTSERVE_CPU_KERNEL=0 above).
step reference "${PYTEST[@]}" -m "not slow" -k "not compiled" tests/test_model_reference.py \
  tests/test_paged_attention.py

dc_finish
