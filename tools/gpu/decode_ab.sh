#!/usr/bin/env bash
# Two moeshard binaries' GPU decode side by side on the device host, in one call: the GPU suite
# (built from the new tree), each binary's decode kernels under Nsight Compute, tg128
# alternating, their greedy texts, and a 512-row step's device time. This is how the
# 2026-12-05 night work was measured (docs/perf.md "Decode kernels as chains of memory
# latencies"; raw output in docs/measurements/2026-12-05-night-gpu-decode-*.txt).
#
# Prepare here: build both `moeshard` binaries (release) and `cargo test --release -p gpu
# --no-run` from the new tree; strip them into PACK/bins.tar.xz as moeshard_main, moeshard_new,
# gpu_kernels, gpu_model; tar the qwen3moe and llama fixture folders into PACK/fixtures.tar.xz.
# The call carries the working tree and PACK within 64 MiB: move crates/model/tests/fixtures,
# fuzz/corpus and models/shakespeare-moe.gguf aside for it (two binaries and the fixtures are
# about 50 MB), and put them back after.
# Run there: bash tools/gpu/decode_ab.sh PACK [ENV=VALUE ...] > $OUT/run.txt 2>&1
# Each ENV=VALUE (an experiment switch of the new binary, say) adds a third column: the new
# binary under that variable.
set -x
R=$PWD; P=$(cd "$1" && pwd); shift
mkdir -p /work && { [ -e /work/main ] || ln -s "$R" /work/main; }
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p crates/model/tests/fixtures && tar xJf "$P/fixtures.tar.xz" -C crates/model/tests/fixtures
mkdir -p /var/tmp/b && tar xJf "$P/bins.tar.xz" -C /var/tmp/b
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; date +%T
M=/var/tmp/b/moeshard_main N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf
( [ -s $Q ] || timeout 100 $N synth --preset qwen3-30b-a3b $Q > /dev/null; sync; cat $Q > /dev/null ) &
timeout 150 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -v '^$' | tail -12
timeout 240 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -v '^$' | tail -30
wait; date +%T
NCU=(ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv)
# Variant k: "label|env assignments|binary".
VARIANTS=("main||$M" "new||$N")
for e in "$@"; do VARIANTS+=("new $e|$e|$N"); done
for v in "${VARIANTS[@]}"; do
  IFS='|' read -r label envs bin <<< "$v"
  echo "== $label: one decode step's kernels, 26 launches after 3000 (two layers)"
  env $envs MOESHARD_CUDA_GRAPHS=0 timeout 100 "${NCU[@]}" --launch-skip 3000 --launch-count 26 \
    "$bin" run -m $Q -p hello -n 12 --gpu -t 16 --temp 0 2>&1 |
    awk -F'","' '/gpu__time_duration.sum/ {gsub(/"/, "", $NF); printf "%-40s %-16s %10s %s\n", substr($5, 1, 40), $9, $NF, $(NF-1)}'
done
for round in 1 2; do
  for v in "${VARIANTS[@]}"; do
    IFS='|' read -r label envs bin <<< "$v"
    echo "== $label, round $round"
    env $envs MOESHARD_GPU_TIMING=1 timeout 60 "$bin" bench -m $Q -t 16 --gpu -p 0 -n 128 -r 2 2>&1 | tail -2
  done
done
date +%T
for v in "${VARIANTS[@]}"; do
  IFS='|' read -r label envs bin <<< "$v"
  env $envs timeout 60 "$bin" run -m $Q -p "The river" -n 32 --gpu -t 16 --temp 0 2>/dev/null > "/tmp/text-${label// /_}.txt"
  echo "== $label greedy text: $(md5sum < "/tmp/text-${label// /_}.txt")"
  env $envs MOESHARD_GPU_TIMING=1 timeout 60 "$bin" bench -m $Q -t 16 --gpu -p 512 -n 0 -r 2 2>&1 | grep -E "pp512|gpu timing"
done
date +%T; echo done
