#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with the CUDA backend on the device host, into
# /var/tmp/ll/build/bin (kept while the machine stays warm; nothing is done if it is there).
# PACK/llama-src.tar.xz is llama.cpp's source from the PyPI sdist without the top-level models/,
# docs/, examples/, tests/ and gguf-py/; src/models and tools/mtmd/models must stay (a tarball
# that dropped every `models` folder does not configure). About 4.5 minutes with 16 jobs.
# Usage there: bash tools/gpu/build_llama.sh PACK   (prints "llama.cpp build rc=N" at the end)
P=$(cd "$1" && pwd)
[ -x /var/tmp/ll/build/bin/llama-bench ] && { echo "llama.cpp build rc=0 (already built)"; exit 0; }
export PATH=/usr/local/cuda/bin:/opt/torch/.venv/bin:$PATH
rm -rf /var/tmp/ll && mkdir -p /var/tmp/ll && tar xJf "$P/llama-src.tar.xz" -C /var/tmp/ll && cd /var/tmp/ll &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    > /var/tmp/llcfg.log 2>&1 &&
  cmake --build build -j 16 --target llama-bench > /var/tmp/llbuild.log 2>&1
rc=$?
[ $rc = 0 ] || tail -5 /var/tmp/llcfg.log /var/tmp/llbuild.log
echo "llama.cpp build rc=$rc $(date +%T)"
