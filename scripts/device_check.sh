#!/usr/bin/env bash
# The one GPU run: every `cuda`-marked test (the Triton kernels compiled, graphs on/off, device sampling), then the
# benchmarks (scripts/bench_attention.py: triton vs torch attention; scripts/bench_gpu.py: decode against the
# memory-bandwidth floor with CUDA graphs and eagerly and per attention backend, prefill against a GEMM, swaps
# against a pinned memcpy) and a quick engine benchmark, with that machine's own python3 and torch (nothing
# installed, no network). Each part has a timeout; together they stay under 8 minutes. Results go to $OUT (the
# device tool's folder) or results/device: env.txt, tests_cuda.log, tests_reference.log, bench_attention.{log,json},
# bench_gpu.{log,json}, bench_engine.{log,json}.
#
#   bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FASTSERVE_DEFAULT_MODEL=/tmp/fastserve-tiny-opt
PY=${PYTHON:-python3}
START=$SECONDS

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None, 'transformers', transformers.__version__)"
  $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"

# Every CUDA test, at most 170 s: the files that mark any (collecting the whole suite would import the server's
# dependencies, which this machine may lack), and in them only the `cuda`-marked tests.
CUDA_TESTS=$(grep -l "pytest.mark.cuda" tests/test_*.py)
echo "cuda test files:" $CUDA_TESTS | tee "$OUT/tests_cuda.log"
timeout 170 $PY -m pytest -q -p no:cacheprovider -m cuda $CUDA_TESTS 2>&1 | tee -a "$OUT/tests_cuda.log"
# The model reference and attention tests on this machine's install (they run on CPU here too), at most 45 s.
timeout 45 $PY -m pytest -q -p no:cacheprovider -m "not slow" tests/test_model_reference.py \
  tests/test_paged_attention.py 2>&1 | tee "$OUT/tests_reference.log"
# The compiled Triton kernels' speed against the reference attention (same run, same inputs), at most 60 s.
timeout 60 $PY scripts/bench_attention.py --shape opt-13b --dtype float16 --json "$OUT/bench_attention.json" \
  2>&1 | tee "$OUT/bench_attention.log"

# OPT-13B-shaped dummy weights in float16: decode at batch 1/32/256 (context 512), prefill 8 x 1024, swaps.
timeout 140 $PY scripts/bench_gpu.py --device cuda --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"

# The engine end to end on an opt-125m-shaped checkpoint against transformers' generate (quick workloads).
timeout 60 $PY scripts/bench_engine.py --quick --device cuda --dtype float16 --model /tmp/opt-125m-random \
  --json "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench_engine.log"
echo "device_check: $((SECONDS - START)) s; results in $OUT"
