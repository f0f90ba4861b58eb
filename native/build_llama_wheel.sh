#!/usr/bin/env bash
# Build (once) and print the path of a llama-cpp-python wheel for this CPU.
#
# llama.cpp's default "native" build turns on every instruction set the CPU
# reports. On x86 that includes AMX, whose kernels crash (SIGSEGV in
# ggml_backend_amx_mul_mat) in VMs that report AMX without granting it, as on
# this project's build machines. So on x86_64 we pick the instruction sets
# explicitly from /proc/cpuinfo, AMX never; elsewhere (aarch64 boards) native.
# The wheel is cached under a key of version + flags, so reruns take seconds.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${MAGNITUDE_WHEEL_CACHE:-$HOME/.cache/magnitude/wheels}"
PYTHON="${PYTHON:-python3}"

args=()
if [ "$(uname -m)" = "x86_64" ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  args+=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 \
              avx_vnni:GGML_AVX_VNNI avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI \
              avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16; do
    cpu_flag=${pair%%:*}; option=${pair##*:}
    if [[ "$flags" == *" $cpu_flag "* ]]; then args+=("-D$option=ON"); else args+=("-D$option=OFF"); fi
  done
fi
key=$(printf '%s %s\n' "$VERSION" "${args[*]:-native}" | sha256sum | cut -c1-12)
dir="$CACHE/llama-cpp-python-$VERSION-$key"

if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  mkdir -p "$dir"
  echo "building llama-cpp-python $VERSION (about 4-5 minutes on 2 cores; cached in $dir)" >&2
  echo "  CMAKE_ARGS=${args[*]:-}" >&2
  CMAKE_ARGS="${args[*]:-}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PYTHON" -m pip wheel --no-deps --no-cache-dir -w "$dir.tmp" "llama-cpp-python==$VERSION" >&2
  mv "$dir.tmp"/llama_cpp_python-*.whl "$dir"/ && rmdir "$dir.tmp"
fi
ls "$dir"/llama_cpp_python-*.whl | head -n1
