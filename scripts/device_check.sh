#!/usr/bin/env bash
# The one GPU run, at most 8 minutes (DEVICE_CHECK_BUDGET_S, default 480 s), so that a second run fits in a
# 15-minute lease. Each step has its own time limit (`timeout`); the table says PASS / FAIL / TIMEOUT / SKIP,
# seconds, Triton compiles and exit status per step, and the script exits non-zero unless every step passed.
# Everything (each step's log, the JSON results, the table as text and summary.json) goes into ONE archive,
# $OUT/device_check.tar.gz ($OUT: the device tool's folder; results/device when unset), because only a few
# files come back from the GPU machine. Nothing is read from outside the repository: test models are written
# into a scratch folder, and the engine benchmark's ShareGPT lengths come from tests/data.
#
# Versions: the machine's own python3, torch and Triton (printed beside the pinned torch==2.13.0 and
# triton==3.7.1); nothing is installed (no network there). Without a CUDA device it fails at once and says so.
#
# Steps, in order of importance (a step that would run past the budget gets what is left; later ones are SKIP):
#   env           versions, the GPU (scripts/device_env.py)                                         limit  40 s
#   kernels       the compiled Triton kernels against the reference (tests/test_triton_kernels.py -m cuda),
#                 first, with --durations: 32 distinct kernel specializations (4 write_kv, 12 decode split,
#                 12 decode reduce, 4 prefill: 2 dtypes x 2 padded head dims x 3 split sizes), counted
#                 under the interpreter; at 2-3 s a compile on a cold cache, 64-96 s serially, about a
#                 sixth of that with pytest-xdist (-n 6, used when the machine has it)                limit 150 s
#   cuda_tests    every other `cuda`-marked test (engine on CUDA vs transformers and vs CPU, float16 /
#                 bfloat16, graphs vs eager per backend, the device sampler, penalties without a sync),
#                 serially (one test sizes its KV cache from 90% of the GPU): 6 (dtype, head dim, block
#                 size) configurations x ~11 specializations (decode block-table widths and split counts)
#                 = ~65 compiles, 130-200 s                                                          limit 200 s
#   reference     the model and attention reference tests on this machine's torch, on CPU           limit  40 s
#   bench_attention  Triton vs torch attention at OPT-13B's shape, float16; fails past its tolerance  limit  60 s
#   bench_gpu     decode vs the HBM floor (graphs/eager, per backend), prefill vs GEMM, swaps vs memcpy limit 120 s
#   bench_engine  the engine vs transformers' generate, opt-125m shape, float16, --quick              limit  60 s
#   control_plane a decode step's wall time vs the executor's compute, sync / async output / async
#                 scheduling, on bench_engine's opt-125m-shaped model, batch 32 and 256             limit  90 s
#
#   bash scripts/device_check.sh            # PYTHON=... to use another interpreter than python3
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_check_steps.sh

OUT=${OUT:-results/device}
PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-480}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastserve-device-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
RES=$WORK/device_check  # what the archive holds; models and the Triton cache stay beside it, outside the archive
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export FASTSERVE_DEFAULT_MODEL=$WORK/models/tiny-opt  # never built: the tests build their own models
export FASTSERVE_CPU_KERNEL=0  # the CPU decode kernel's g++ build (~20 s) is for CPU speed, not this check
export TRITON_CACHE_DIR=$WORK/triton_cache  # empty: every compile counted in the table
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --durations=0)

dc_begin "$RES" "$BUDGET"
echo "[device_check] results into $OUT/device_check.tar.gz; budget $BUDGET s"
dc_step env 40 "$PY" scripts/device_env.py --json "$RES/env.json" ||
  dc_stop "no usable CUDA device (env.log says why)"

XDIST=()
if [ -z "$DC_STOP_REASON" ] && "$PY" -c "import xdist" 2>/dev/null; then
  XDIST=(-n 6)  # the 6 (dtype, head dim) cases compile in parallel
fi
dc_step kernels 150 "${PYTEST[@]}" "${XDIST[@]}" -m cuda tests/test_triton_kernels.py

mapfile -t CUDA_FILES < <(grep -l "pytest.mark.cuda" tests/test_*.py | grep -v "tests/test_triton_kernels.py")
dc_step cuda_tests 200 "${PYTEST[@]}" -m cuda "${CUDA_FILES[@]}"

dc_step reference 40 "${PYTEST[@]}" -m "not slow" tests/test_model_reference.py tests/test_paged_attention.py

dc_step bench_attention 60 "$PY" scripts/bench_attention.py --shape opt-13b --dtype float16 \
  --json "$RES/bench_attention.json"

dc_step bench_gpu 120 "$PY" scripts/bench_gpu.py --device cuda --json "$RES/bench_gpu.json"

dc_step bench_engine 60 "$PY" scripts/bench_engine.py --quick --device cuda --dtype float16 \
  --model "$WORK/models/opt-125m-random" --lengths tests/data/sharegpt_fig15_trace.json --json "$RES/bench_engine.json"

dc_step control_plane 90 "$PY" scripts/bench_control_plane.py --device cuda --model "$WORK/models/opt-125m-random" \
  --batch 32,256 --steps 20 --repeats 1

dc_finish "$OUT/device_check.tar.gz"
