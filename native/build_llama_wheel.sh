#!/usr/bin/env bash
# Build (once) and print the path of a llama-cpp-python wheel for this CPU (flags: cmake_args.sh).
# The wheel is cached under a key of version + flags, so reruns take seconds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=cmake_args.sh
source "$here/cmake_args.sh"

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${MAGNITUDE_WHEEL_CACHE:-$HOME/.cache/magnitude/wheels}"
PYTHON="${PYTHON:-python3}"

args="$(llama_cmake_args)"
key=$(printf '%s %s\n' "$VERSION" "${args:-native}" | sha256sum | cut -c1-12)
dir="$CACHE/llama-cpp-python-$VERSION-$key"

if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  mkdir -p "$dir"
  echo "building llama-cpp-python $VERSION (about 4-5 minutes on 2 cores; cached in $dir)" >&2
  echo "  CMAKE_ARGS=$args" >&2
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PYTHON" -m pip wheel --no-deps --no-cache-dir -w "$dir.tmp" "llama-cpp-python==$VERSION" >&2
  mv "$dir.tmp"/llama_cpp_python-*.whl "$dir"/ && rmdir "$dir.tmp"
fi
ls "$dir"/llama_cpp_python-*.whl | head -n1
