#!/usr/bin/env bash
# Build (once) and print the path of llama.cpp's own `llama-server`: the peer every benchmark compares
# Magnitude with. It is built from the llama.cpp sources vendored in the pinned llama-cpp-python sdist,
# with the same CPU flags as our wheel (cmake_args.sh), so both run the same kernels.
# Cached under a key of version + flags in $MAGNITUDE_HOME/native (default ~/.cache/magnitude/native).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=cmake_args.sh
source "$here/cmake_args.sh"

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${MAGNITUDE_HOME:-$HOME/.cache/magnitude}/native"
PYTHON="${PYTHON:-python3}"

args="$(llama_cmake_args)"
key=$(printf '%s %s server\n' "$VERSION" "${args:-native}" | sha256sum | cut -c1-12)
dir="$CACHE/llama-server-$VERSION-$key"

if [ ! -x "$dir/bin/llama-server" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  echo "building llama-server from llama-cpp-python $VERSION's vendored llama.cpp (about 5 minutes on 2 cores;" \
       "cached in $dir)" >&2
  "$PYTHON" -m pip download --no-deps --no-binary :all: -q -d "$work" \
    "llama-cpp-python==$VERSION" >&2
  tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $args >&2
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
  mkdir -p "$dir/bin"
  cp "$work/build/bin/llama-server" "$dir/bin/"
  git -C "$src" log -1 --format=%H >/dev/null 2>&1 || true
  echo "$VERSION" > "$dir/llama-cpp-python-version"
fi
echo "$dir/bin/llama-server"
