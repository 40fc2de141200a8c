#!/usr/bin/env bash
# The GPU suite and the qwen3-30b-a3b benchmark on the device host, from binaries built here.
# Prepare (on this machine): build `moeshard` (release) and `cargo test --release -p gpu --no-run`,
# strip them into PACK/bins.tar.xz as moeshard_new, gpu_kernels, gpu_model; tar the qwen3moe and
# llama fixture folders into PACK/fixtures.tar.xz and llama.cpp's source (without the top-level
# models/ of vocab files, docs, examples, tests; src/models and tools/mtmd are needed: a tarball
# that dropped every `models` folder failed to build on 2026-12-05) into PACK/llama-src.tar.xz; move crates/model/tests/fixtures aside so the
# working tree stays under the 64 MiB the device call carries; carry PACK.
# Run there: bash PACK/device_suite.sh > $OUT/run.txt 2>&1
# A variant of this script ran on 2026-12-05 (docs/measurements/2026-12-05-gpu-tensor-cores-q30.txt,
# which ends with the scripts as run). Device time is scarce: a refused start costs about 90 s of
# the session's budget and a fresh machine about two minutes, so keep one call self-contained and
# under ten minutes, and start the next within the 30 s the machine stays warm.
set -x
R=$PWD; P=$(cd "$(dirname "$0")" && pwd)
# The test binaries look for fixtures under the absolute path they were built at.
mkdir -p /work && { [ -e /work/main ] || ln -s "$R" /work/main; }
mkdir -p crates/model/tests/fixtures && tar xJf "$P/fixtures.tar.xz" -C crates/model/tests/fixtures
mkdir -p /var/tmp/b && tar xJf "$P/bins.tar.xz" -C /var/tmp/b
export PATH=/usr/local/cuda/bin:/opt/torch/.venv/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
bash "$R/tools/gpu/build_llama.sh" "$P" &
B=/var/tmp/b/moeshard_new
time timeout 90 $B synth --preset qwen3-30b-a3b /tmp/q30.gguf
timeout 200 /var/tmp/b/gpu_kernels --nocapture --test-threads 1 2>&1 | grep -v '^$' | tail -70
timeout 240 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -v '^$' | tail -60
for i in 1 2; do
  MOESHARD_GPU_TIMING=1 timeout 150 $B bench -m /tmp/q30.gguf -t 16 --gpu -p 512 -n 64 -r 2 2>&1 | tail -6
  MOESHARD_GPU_MMA=0 MOESHARD_GPU_TIMING=1 timeout 150 $B bench -m /tmp/q30.gguf -t 16 --gpu -p 512 -n 64 -r 2 2>&1 | tail -4
done
wait
tail -3 /var/tmp/llbuild.log
timeout 150 /var/tmp/ll/build/bin/llama-bench -m /tmp/q30.gguf -ngl 99 -p 512 -n 64 -r 2 2>&1 | tail -6
