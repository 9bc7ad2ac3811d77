#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server (the peer for bench/vs_llamacpp.py)
# from llama-cpp-python's source distribution, into a cache folder outside the repo.
# Bench-only: nothing here is part of `make test` or the default install.
#
# Usage: bench/llamacpp_peer.sh        -> prints the folder holding the two binaries
# Env:   WAVEMESH_CACHE (default ~/.cache/wavemesh), PYTHON (default python3), JOBS (default 2)
set -euo pipefail

cache="${WAVEMESH_CACHE:-$HOME/.cache/wavemesh}/llamacpp"
python="${PYTHON:-python3}"
jobs="${JOBS:-2}"
bin_dir="$cache/build/bin"

if [[ -x "$bin_dir/llama-bench" && -x "$bin_dir/llama-server" ]]; then
    echo "$bin_dir"
    exit 0
fi

mkdir -p "$cache/sdist"
if ! ls "$cache"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$python" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$cache/sdist" >&2
fi
sdist="$(ls "$cache"/sdist/llama_cpp_python-*.tar.gz | sort | tail -n 1)"

if [[ ! -f "$cache/src/CMakeLists.txt" ]]; then
    rm -rf "$cache/src" "$cache/unpack"
    mkdir -p "$cache/unpack"
    tar -xzf "$sdist" -C "$cache/unpack"
    mv "$cache"/unpack/llama_cpp_python-*/vendor/llama.cpp "$cache/src"
    rm -rf "$cache/unpack"
    basename "$sdist" > "$cache/src/SOURCE"
fi

cmake -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$cache/build" --target llama-bench llama-server -j "$jobs" >&2
echo "$bin_dir"
