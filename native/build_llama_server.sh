#!/usr/bin/env bash
# Build (once) and print the path of llama.cpp's own `llama-server`: the peer every benchmark compares
# Magnitude with. It is built from the llama.cpp sources vendored in the pinned llama-cpp-python sdist,
# with the same CPU flags as our wheel (cmake_args.sh), so both run the same kernels.
# Cached in $MAGNITUDE_HOME/native (default ~/.cache/magnitude/native).
set -euo pipefail
# shellcheck source=cmake_args.sh
source "$(dirname "$0")/cmake_args.sh"

dir="$(llama_cache_dir "${MAGNITUDE_HOME:-$HOME/.cache/magnitude}/native" llama-server server)"
if [ ! -x "$dir/bin/llama-server" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  echo "building llama-server from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's vendored llama.cpp" \
       "(about 5 minutes on 2 cores; cached in $dir)" >&2
  "${PYTHON:-python3}" -m pip download --no-deps --no-binary :all: -q -d "$work" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  tar -xzf "$work"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  # shellcheck disable=SC2046
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $(llama_cmake_args) >&2
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
  mkdir -p "$dir/bin"
  cp "$work/build/bin/llama-server" "$dir/bin/"
fi
echo "$dir/bin/llama-server"
