#!/usr/bin/env bash
# Builds examples/candle-llama (release) on a machine without a GPU and copies the executable to
# gpu-run/candle-llama and gpu-run/candle-llama.gz (ignored by git; carry either to the GPU
# machine, where the gate's candle phase unpacks the second). The example is its own
# package with its own workspace: the crate's build, tests, CI and package never build it.
#
# candle links the CUDA libraries at build time, so this installs, in target/candle-venv:
# the CUDA 13.0 toolkit wheels (nvcc, the runtime headers, CCCL, which candle-kernels' .cu files
# need), and the libraries candle links (cuBLAS, cuBLASLt, cuRAND, NVRTC, the runtime). The
# driver library is a stub made here (every entry point cudarc names, soname libcuda.so.1): the
# GPU machine's driver is the one loaded at run time. candle-kernels takes ~10 minutes on 2 cores.
#
# Run on the GPU machine with the CUDA 13 libraries of its Python on the library path:
#   LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))') \
#     gpu-run/candle-llama --help
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CANDLE_VENV:-$PWD/target/candle-venv}
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-runtime==13.0.96 'nvidia-cuda-cccl==13.0.*' 'nvidia-cublas==13.0.*' 'nvidia-curand==10.4.0.*' \
  'nvidia-cuda-nvrtc==13.0.*'
root=$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13)
[ -x "$root/bin/nvcc" ] || { echo "build-candle-example: no nvcc under $root"; exit 1; }

# The linker's names for the wheels' versioned libraries.
for lib in cublas cublasLt curand nvrtc cudart; do
  versioned=$(ls "$root/lib/lib$lib.so."* | sort | head -1)
  ln -sf "$(basename "$versioned")" "$root/lib/lib$lib.so"
done
# The driver stub: every cu* entry point of cudarc's driver bindings, none of which runs.
mkdir -p "$root/lib/stubs"
bindings=$(cargo metadata --format-version 1 --manifest-path examples/candle-llama/Cargo.toml \
  | python3 -c 'import json, sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc").rsplit("/", 1)[0])')/src/driver/sys/mod.rs
sed -n 's/^pub unsafe fn \(cu[A-Za-z0-9_]*\)(.*/void \1(void) {}/p' "$bindings" | sort -u > target/libcuda_stub.c
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" target/libcuda_stub.c

export PATH="$root/bin:$PATH" CUDA_ROOT="$root" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export NVCC_PREPEND_FLAGS="-I$root/include/cccl ${NVCC_PREPEND_FLAGS:-}"
cargo build --release --manifest-path examples/candle-llama/Cargo.toml
mkdir -p gpu-run
cp examples/candle-llama/target/release/ppnrt-candle-llama gpu-run/candle-llama
strip --strip-debug gpu-run/candle-llama
# Compressed too (~1/3): with the test bundle it then fits what one call to the GPU machine carries.
gzip -kf gpu-run/candle-llama
echo "built gpu-run/candle-llama (and gpu-run/candle-llama.gz)"
