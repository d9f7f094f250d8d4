#!/usr/bin/env bash
# Compile check of Shoal's CUDA kernels; needs nvcc, not a GPU.
#
#   * every kernels/csrc/*.cu with nvcc for each arch (sm_80 and sm_90 unless
#     SHOAL_CUDA_ARCHS says otherwise), with the flags torch.utils.cpp_extension
#     adds, compile only (-c): device code through ptxas for every arch;
#   * every kernels/csrc/*.cpp (the torch bindings) with the host compiler,
#     syntax only, against the installed torch's headers.
#
# All compiles run in parallel, one nvcc call per .cu for all archs. Prints one
# line per compile; exits non-zero if any failed. Environment: NVCC, CXX,
# CUDA_HOME, SHOAL_CUDA_ARCHS, and PYTHON (default: $VIRTUAL_ENV/bin/python,
# else the repository's .venv/bin/python, else python3) to find torch.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
csrc="$root/kernels/csrc"
nvcc=${NVCC:-nvcc}
cxx=${CXX:-c++}
read -r -a archs <<<"${SHOAL_CUDA_ARCHS:-80 90}"
if [[ -z ${PYTHON:-} ]]; then
  if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
    PYTHON=$VIRTUAL_ENV/bin/python
  elif [[ -x $root/.venv/bin/python ]]; then
    PYTHON=$root/.venv/bin/python  # the project venv, as .ci/run makes it (not activated)
  else
    PYTHON=python3
  fi
fi

if ! nvcc_path=$(command -v "$nvcc"); then
  echo "check_kernels: nvcc not found (put it on PATH or set NVCC)" >&2
  exit 2
fi
# nvcc may be a wrapper script: ask it where its toolkit is.
cuda_home=${CUDA_HOME:-$("$nvcc_path" -v --dryrun -x cu -c /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')}
if ! torch_includes=$("$PYTHON" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
print("\n".join(include_paths() + [sysconfig.get_paths()["include"]]))'); then
  echo "check_kernels: $PYTHON cannot import torch (activate the project venv or set PYTHON)" >&2
  exit 2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# What torch.utils.cpp_extension passes to nvcc for every .cu: code that needs
# implicit half/bfloat16 conversions builds here but not there.
nvcc_flags=(-std=c++20 -O3 -lineinfo -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ -I "$csrc")
cxx_flags=(-std=c++20 -fsyntax-only -Wall -Wextra -DTORCH_EXTENSION_NAME=shoal_kv_ops -I "$csrc"
  -isystem "$cuda_home/include")
while IFS= read -r include; do
  cxx_flags+=(-isystem "$include")
done <<<"$torch_includes"

# compile NAME COMMAND...: runs COMMAND, prints "ok NAME" or "FAILED NAME" and its output.
compile() {
  local name=$1
  shift
  if "$@" >"$out/$name.log" 2>&1; then
    echo "ok      $name"
    [[ -s $out/$name.log ]] && sed 's/^/        /' "$out/$name.log"
    return 0
  fi
  echo "FAILED  $name: $*"
  sed 's/^/        /' "$out/$name.log"
  return 1
}

shopt -s nullglob
cu_files=("$csrc"/*.cu)
cpp_files=("$csrc"/*.cpp)
if ((${#cu_files[@]} == 0)); then
  echo "check_kernels: no .cu files in $csrc" >&2
  exit 1
fi
echo "check_kernels: $("$nvcc" --version | tail -n 1); archs: ${archs[*]}"

# One nvcc call per .cu builds every arch (-gencode per arch): the host side of the
# file (preprocessing, cudafe, the host compiler) runs once instead of once per arch,
# and --threads runs the per-arch device compiles in parallel inside the call.
gencode=()
arch_names=()
for arch in "${archs[@]}"; do
  gencode+=(-gencode "arch=compute_$arch,code=sm_$arch")
  arch_names+=("sm_$arch")
done
arch_label=$(IFS=+; echo "${arch_names[*]}")

pids=()
for source in "${cu_files[@]}"; do
  name=$(basename "$source" .cu)
  compile "$name.cu:$arch_label" "$nvcc" "${nvcc_flags[@]}" "${gencode[@]}" --threads "${#archs[@]}" \
    -c "$source" -o "$out/$name.o" &
  pids+=($!)
done
for source in "${cpp_files[@]}"; do
  compile "$(basename "$source"):host" "$cxx" "${cxx_flags[@]}" "$source" &
  pids+=($!)
done

failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=$((failed + 1))
done
if ((failed > 0)); then
  echo "check_kernels: $failed of ${#pids[@]} compiles FAILED" >&2
  exit 1
fi
echo "check_kernels: all ${#pids[@]} compiles passed"
