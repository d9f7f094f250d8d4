#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run (a GPU lease is short): Shoal's CUDA
# extension built for the visible GPU, tests/gpu, the kernel benchmark, where a WARM wake's
# time goes (profile_wake.py) and bench_swap's part 1 on the GPU. Each step's output goes to
# $OUT (default ./gpu-checks) and a failed step does not stop the next. Needs python3 with
# CUDA torch and Shoal importable; makes the demo models under $SHOAL_TEST_MODELS_ROOT
# (default /tmp/shoal-models) first.
#
#   OUT=/tmp/gpu bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-$PWD/gpu-checks}
mkdir -p "$out"
export SHOAL_TEST_MODELS_ROOT=${SHOAL_TEST_MODELS_ROOT:-/tmp/shoal-models}
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a timeout, its output in $out/NAME.log
  local name=$1 seconds=$2
  shift 2
  local started=$SECONDS
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - started)) s" | tee -a "$out/summary.txt"
  [[ $rc -eq 0 ]] || status=1
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} >"$out/summary.txt" 2>&1
step demo_models 240 "$python" -c 'import os, pathlib; from shoal.cli.demo_models import make_demo_models; make_demo_models(pathlib.Path(os.environ["SHOAL_TEST_MODELS_ROOT"]))'
step build_extension 300 "$python" -c 'from shoal.kernels import cuda_ext; cuda_ext.load_extension(); print("built")'
step tests_gpu 420 "$python" -m pytest -n 0 -p no:cacheprovider -q -rs tests/gpu
step bench_kernels_gpu 180 "$python" scripts/bench_kernels_gpu.py --quick
step profile_wake 120 "$python" scripts/profile_wake.py --repeats 5 --models-root "$SHOAL_TEST_MODELS_ROOT"
step bench_swap_cuda 180 "$python" scripts/bench_swap.py --skip-replay --device cuda --repeats 3 --models-root "$SHOAL_TEST_MODELS_ROOT"
exit $status
