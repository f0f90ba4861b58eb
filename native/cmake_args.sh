#!/usr/bin/env bash
# What the build scripts beside this one share (they source it): the pinned llama-cpp-python version,
# llama.cpp's CMake arguments for this CPU, and a cache folder keyed by both.
#
# llama.cpp's default "native" build turns on every instruction set the CPU
# reports. On x86 that includes AMX, whose kernels crash (SIGSEGV in
# ggml_backend_amx_mul_mat) in VMs that report AMX without granting it, as on
# this project's build machines. So on x86_64 we pick the instruction sets
# explicitly from /proc/cpuinfo, AMX never; elsewhere (aarch64 boards) native.
# Extra arguments for a board (e.g. -DGGML_CUDA=ON on a Jetson) come from $MAGNITUDE_CMAKE_EXTRA.
llama_cmake_args() {
  local args=()
  if [ "$(uname -m)" = "x86_64" ]; then
    local flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    args+=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 \
                avx_vnni:GGML_AVX_VNNI avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI \
                avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16; do
      local cpu_flag=${pair%%:*} option=${pair##*:}
      if [[ "$flags" == *" $cpu_flag "* ]]; then args+=("-D$option=ON"); else args+=("-D$option=OFF"); fi
    done
  fi
  # shellcheck disable=SC2206
  args+=(${MAGNITUDE_CMAKE_EXTRA:-})
  echo "${args[*]:-}"
}

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

# llama_cache_dir ROOT NAME [TAG]: ROOT/NAME-VERSION-KEY, KEY a hash of the version, this CPU's arguments
# and TAG, so a build is reused until one of them changes.
llama_cache_dir() {
  local args key
  args="$(llama_cmake_args)"
  key=$(printf '%s %s%s\n' "$LLAMA_CPP_PYTHON_VERSION" "${args:-native}" "${3:+ $3}" | sha256sum | cut -c1-12)
  echo "$1/$2-$LLAMA_CPP_PYTHON_VERSION-$key"
}
