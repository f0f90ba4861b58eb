#!/usr/bin/env bash
# Build (once) and print the path of a llama-cpp-python wheel for this CPU (flags: cmake_args.sh).
# The wheel is cached under a key of version + flags, so reruns take seconds.
set -euo pipefail
# shellcheck source=cmake_args.sh
source "$(dirname "$0")/cmake_args.sh"

dir="$(llama_cache_dir "${MAGNITUDE_WHEEL_CACHE:-$HOME/.cache/magnitude/wheels}" llama-cpp-python)"
if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  mkdir -p "$dir"
  args="$(llama_cmake_args)"
  echo "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (about 4-5 minutes on 2 cores; cached in $dir)" >&2
  echo "  CMAKE_ARGS=$args" >&2
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${PYTHON:-python3}" -m pip wheel --no-deps --no-cache-dir -w "$dir.tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  mv "$dir.tmp"/llama_cpp_python-*.whl "$dir"/ && rmdir "$dir.tmp"
fi
ls "$dir"/llama_cpp_python-*.whl | head -n1
