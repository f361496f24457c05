#!/usr/bin/env bash
# Build tools/marlin_cuda/build/libmocli_marlin.so: vLLM 0.32.0's Marlin GEMM (FP4 weights x BF16
# activations only) behind a torch-free extern "C" entry (src/mocli_marlin.cu). See README.md.
#   JOBS=2 NVCC=/usr/local/cuda/bin/nvcc ARCH=90a tools/marlin_cuda/build.sh
# Needs python3 with jinja2 (vLLM's generator); nothing else outside the CUDA toolkit.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NVCC="${NVCC:-/usr/local/cuda/bin/nvcc}"
ARCH="${ARCH:-90a}"
JOBS="${JOBS:-1}"
PY="${PYTHON:-python3}"
OUT="$HERE/build"
GEN="$OUT/gen"
rm -rf "$GEN" "$OUT/obj"
mkdir -p "$GEN" "$OUT/obj"
"$PY" "$HERE/src/generate_kernels.py" "${ARCH:0:1}.${ARCH:1}" "$GEN"
# vLLM's CUDA flags for these sources (torch's get_torch_gpu_compiler_flags, -O3, static cudart, and
# -static-global-template-stub=false, which vLLM's CMakeLists.txt sets on the Marlin sources for CUDA >= 12.8).
FLAGS=(-std=c++17 -O3 --threads 1 -gencode "arch=compute_${ARCH},code=sm_${ARCH}" -Xcompiler -fPIC
       --expt-relaxed-constexpr --expt-extended-lambda -static-global-template-stub=false
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -I"$HERE/src" -I"$GEN")
compile() {  # src obj (always a full build: the generator rewrites its files on every run)
  echo "nvcc $(basename "$1")"
  "$NVCC" "${FLAGS[@]}" -c "$1" -o "$2"
}
SRCS=("$HERE/src/mocli_marlin.cu" "$GEN"/sm80_kernel_*.cu)
pids=(); objs=()
for s in "${SRCS[@]}"; do
  o="$OUT/obj/$(basename "${s%.cu}").o"; objs+=("$o")
  compile "$s" "$o" &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
done
for p in "${pids[@]}"; do wait "$p"; done  # set -e: a failed compile stops the link
# libstdc++/libgcc linked in statically, so the library loads on a machine with an older libstdc++.
"$NVCC" -shared -gencode "arch=compute_${ARCH},code=sm_${ARCH}" -Xcompiler -static-libstdc++ -Xcompiler -static-libgcc \
  "${objs[@]}" -o "$OUT/libmocli_marlin.so"
ls -la "$OUT/libmocli_marlin.so"
