#!/usr/bin/env bash
# Builds the test images of tests/data/test_params.cu that tests/gpu/launch.rs loads: a fatbin (sm_90
# SASS and compute_90 PTX) and an sm_90 cubin, into tests/data/. Needs nvcc (CUDA 13.0: the PyPI
# nvidia-cuda-nvcc wheel, or a toolkit); NVCC names it when it is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || ls .ci-venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -1)}
[ -n "$nvcc" ] || { echo "build-test-kernels: no nvcc (set NVCC)" >&2; exit 1; }
root=$(dirname "$(dirname "$nvcc")")
inc=()
for dir in "$root/include" "$root"/../*/include; do [ -d "$dir" ] && inc+=(-I "$dir"); done
"$nvcc" "${inc[@]}" -fatbin -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
  -o tests/data/test_params.fatbin tests/data/test_params.cu
"$nvcc" "${inc[@]}" -cubin -arch=sm_90 -o tests/data/test_params.cubin tests/data/test_params.cu
ls -l tests/data/test_params.*
