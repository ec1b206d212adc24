#!/usr/bin/env bash
# The one command to run on a GPU machine: the CUDA tests, the attention and engine benchmarks,
# with that machine's own python3 and torch (nothing installed, no network), in
# under five minutes. Results go to $OUT (the device tool's folder) or results/device.
#
#   bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FASTSERVE_DEFAULT_MODEL=/tmp/fastserve-tiny-opt
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

# CUDA tests, plus the model reference and engine tests (they run on CPU there too: a sanity check of the install).
timeout 200 $PY -m pytest -q -p no:cacheprovider -m "cuda" tests/test_cuda.py 2>&1 | tee "$OUT/tests_cuda.log"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_model_reference.py tests/test_paged_attention.py \
  2>&1 | tee "$OUT/tests_reference.log"
# The compiled Triton kernels against the reference, and their speed against it (same run, same inputs).
timeout 200 $PY -m pytest -q -p no:cacheprovider -m "cuda" tests/test_triton_kernels.py 2>&1 | tee "$OUT/tests_triton.log"
timeout 120 $PY scripts/bench_attention.py --shape opt-13b --dtype float16 --json "$OUT/bench_attention.json" \
  2>&1 | tee "$OUT/bench_attention.log"

# The engine benchmark on an opt-125m-shaped checkpoint, in float16 on the GPU and in float32.
timeout 150 $PY scripts/bench_engine.py --device cuda --dtype float16 --model /tmp/opt-125m-random \
  --json "$OUT/bench_engine_cuda_fp16.json" 2>&1 | tee "$OUT/bench_engine.log"
echo "results in $OUT"
