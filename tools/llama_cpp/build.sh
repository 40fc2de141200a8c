#!/usr/bin/env bash
# Build the reference llama.cpp (the one vendored in llama-cpp-python 0.3.36, i.e.
# ggml-org/llama.cpp@0c1e57098bba43ac29e6e3b677cdceebdd22334f) for fixture generation and
# measurements. CPU only, Release, -DGGML_NATIVE=ON, no network code (no CURL/OpenSSL).
#
#   tools/llama_cpp/build.sh            # build (idempotent; reruns are incremental)
#
# Layout (all git-ignored, never committed):
#   $MOESHARD_CACHE/llama.cpp-src/      vendor/llama.cpp unpacked from the sdist tarball
#   $MOESHARD_CACHE/llama.cpp-build/    CMake/Ninja build tree; binaries in bin/
#   $MOESHARD_CACHE/venv-build/         cmake + ninja from PyPI (only if not on PATH)
# $MOESHARD_CACHE defaults to <repo>/.cache.
#
# Besides llama.cpp's own tools, this compiles tools/llama_cpp/llama_logits.cpp (our measurement
# program, see that file) and llama_dump.cpp (intermediate tensors) against the freshly built
# libllama into llama.cpp-build/bin/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${MOESHARD_CACHE:-$REPO/.cache}"
SRC="$CACHE/llama.cpp-src"
BUILD="$CACHE/llama.cpp-build"
JOBS="${JOBS:-2}"

SDIST_VERSION=0.3.36
TARBALL="$CACHE/downloads/llama_cpp_python-$SDIST_VERSION.tar.gz"
LLAMA_CPP_COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f   # sdist's .git/modules/vendor/llama.cpp/HEAD

# 1. make sure the sdist is downloaded (sha256-checked by the fetch script)
python3 "$REPO/tools/fetch_test_data.py" llama-cpp-python >/dev/null
[[ -f "$TARBALL" ]] || { echo "missing $TARBALL" >&2; exit 1; }
TAR_SHA="$(sha256sum "$TARBALL" | cut -d' ' -f1)"

# 2. unpack vendor/llama.cpp (whole tree: the converter needs conversion/ too)
if [[ ! -f "$SRC/.sdist-sha256" || "$(cat "$SRC/.sdist-sha256")" != "$TAR_SHA" ]]; then
    echo "unpacking vendor/llama.cpp into $SRC" >&2
    rm -rf "$SRC"
    mkdir -p "$SRC"
    # the submodule's .git file points into the sdist's .git/modules; leave it out
    tar -xzf "$TARBALL" -C "$SRC" --strip-components=3 \
        --exclude="llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp/.git" \
        "llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp"
    echo "$LLAMA_CPP_COMMIT" > "$SRC/.llama-cpp-commit"
    echo "$TAR_SHA" > "$SRC/.sdist-sha256"
fi

# 3. cmake + ninja: from PATH, else from PyPI into a venv
if command -v cmake >/dev/null && command -v ninja >/dev/null; then
    CMAKE=cmake; NINJA=ninja
else
    VB="$CACHE/venv-build"
    if [[ ! -x "$VB/bin/cmake" || ! -x "$VB/bin/ninja" ]]; then
        python3 -m venv "$VB"
        "$VB/bin/python" -m pip install --quiet cmake==3.31.6 ninja==1.11.1.4
    fi
    CMAKE="$VB/bin/cmake"; NINJA="$VB/bin/ninja"
fi

# Native CPU flags by default. Some hosts advertise AMX but fault on `ldtilecfg`; for those,
#   LLAMA_NATIVE=0 tools/llama_cpp/build.sh
# builds with GGML_NATIVE=OFF, explicit AVX2/FMA/F16C/AVX-512 and AMX off.
if [[ "${LLAMA_NATIVE:-1}" == 0 ]]; then
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
    CPU_FLAGS=(-DGGML_NATIVE=ON)
fi

# 4. configure + build. GIT_CEILING_DIRECTORIES keeps llama.cpp's build-info from picking up the
#    enclosing moeshard repository; the commit is passed explicitly instead.
export GIT_CEILING_DIRECTORIES="$CACHE"
"$CMAKE" -S "$SRC" -B "$BUILD" -G Ninja \
    -DCMAKE_MAKE_PROGRAM="$NINJA" \
    -DCMAKE_BUILD_TYPE=Release \
    "${CPU_FLAGS[@]}" \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_COMMIT="${LLAMA_CPP_COMMIT:0:9}" -DLLAMA_BUILD_NUMBER=0 \
    >"$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log" >&2; exit 1; }

TARGETS=(llama-quantize llama-bench llama-simple llama-completion llama-perplexity
         llama-eval-callback llama-tokenize llama-batched-bench llama-imatrix)
"$CMAKE" --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

# 5. our measurement program, linked against the shared libllama/libggml of this build tree
LIBDIR="$(dirname "$(find "$BUILD" -name 'libllama.so*' -print -quit)")"
"${CXX:-c++}" -O2 -std=c++17 -Wall \
    -I"$SRC/include" -I"$SRC/ggml/include" \
    "$HERE/llama_logits.cpp" -o "$BUILD/bin/llama-logits" \
    -L"$LIBDIR" -lllama -lggml -lggml-base -Wl,-rpath,"$LIBDIR"
# llama-dump: intermediate tensors as .npy (per-layer comparisons, see llama_dump.cpp)
"${CXX:-c++}" -O2 -std=c++17 -Wall \
    -I"$SRC/include" -I"$SRC/ggml/include" \
    "$HERE/llama_dump.cpp" -o "$BUILD/bin/llama-dump" \
    -L"$LIBDIR" -lllama -lggml -lggml-base -Wl,-rpath,"$LIBDIR"

echo "llama.cpp $LLAMA_CPP_COMMIT built in $BUILD/bin:" >&2
ls "$BUILD/bin" >&2
