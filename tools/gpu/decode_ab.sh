#!/usr/bin/env bash
# moeshard binaries' GPU decode side by side on the device host, in one call: the GPU suite
# (built from the new tree; whole steps again under each variant's switches), tg128 alternating
# twice, each variant's greedy text, a 512-row step's device time, the expert launches' Nsight
# Compute sections, then each variant's decode kernels under ncu while the call's time lasts.
# How the 2026-12-05 night and 2026-12-06 morning decode work was measured (docs/perf.md
# "Decode kernels as chains of memory latencies", "Decode launches on an H100"; raw output in
# docs/measurements/).
#
# Prepare here: build the `moeshard` binaries (release) and `cargo test --release -p gpu
# --no-run` from the new tree; strip them into PACK/bins.tar.xz as moeshard_new (and
# moeshard_main, when a build of main is compared), gpu_kernels, gpu_model; tar the qwen3moe and
# llama fixture folders (others may join) into PACK/fixtures.tar.xz. The call carries the
# working tree and PACK within 64 MiB: move crates/model/tests/fixtures, fuzz/corpus and
# models/shakespeare-moe.gguf aside for it, and put them back after.
# Run there: bash tools/gpu/decode_ab.sh PACK [ENV=VALUE ...] > $OUT/run.txt 2>&1
# Each ENV=VALUE (an experiment switch of the new binary, say) adds a column: the new binary
# under that variable (several variables: "A=0 B=1" as one argument).
set -x
T0=$(date +%s)
source "$(dirname "$0")/unpack_pack.sh" "$1"
shift
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; date +%T
M=/var/tmp/b/moeshard_main N=/var/tmp/b/moeshard_new Q=/var/tmp/q30.gguf
( [ -s $Q ] || timeout 120 $N synth --preset qwen3-30b-a3b $Q > /dev/null; sync; cat $Q > /dev/null ) &
timeout 150 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
timeout 240 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|one row a step|max \|gpu"
bash "$R/tools/gpu/variant_suite.sh" "$@"
wait; date +%T
# Variant k: "label|env assignments|binary".
VARIANTS=()
[ -x $M ] && VARIANTS+=("main||$M")
VARIANTS+=("new||$N")
for e in "$@"; do VARIANTS+=("new $e|$e|$N"); done
for round in 1 2; do
  for v in "${VARIANTS[@]}"; do
    IFS='|' read -r label envs bin <<< "$v"
    out=$(env $envs MOESHARD_GPU_TIMING=1 timeout 60 "$bin" bench -m $Q -t 16 --gpu -p 0 -n 128 -r 2 2>&1)
    echo "== $label, round $round: $(grep tg128 <<< "$out") $(grep 'steps of 1 row' <<< "$out" | tail -1)"
  done
done
date +%T
for v in "${VARIANTS[@]}"; do
  IFS='|' read -r label envs bin <<< "$v"
  env $envs timeout 60 "$bin" run -m $Q -p "The river" -n 32 --gpu -t 16 --temp 0 2>/dev/null > "/tmp/text-${label// /_}.txt"
  echo "== $label greedy text: $(md5sum < "/tmp/text-${label// /_}.txt")"
done
head -c 300 "/tmp/text-new.txt"; echo
for v in "${VARIANTS[@]:0:2}"; do
  IFS='|' read -r label envs bin <<< "$v"
  out=$(env $envs MOESHARD_GPU_TIMING=1 timeout 60 "$bin" bench -m $Q -t 16 --gpu -p 512 -n 0 -r 2 2>&1)
  echo "== $label: $(grep pp512 <<< "$out") $(grep 'steps of 512 rows' <<< "$out" | tail -1)"
done
date +%T
# Where one decode step's expert gate/up and down launches (matmul_one: q/k/v, output, router,
# gate/up, down in a layer, then the head: 241 a token; layer 10 of the sixth decode step)
# spend their time: Nsight Compute's sections, into $OUT/ncu-experts.txt.
if [ -n "${OUT:-}" ]; then
  MOESHARD_CUDA_GRAPHS=0 timeout 90 ncu --cache-control none --clock-control none --kernel-name matmul_one \
    --launch-skip 1258 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section SourceCounters "$N" run -m $Q -p hello -n 8 --gpu -t 16 --temp 0 > "$OUT/ncu-experts.txt" 2>&1
  echo "== ncu sections of gate/up and down: rc $?"
fi
NCU=(ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv)
for v in "${VARIANTS[@]}"; do
  [ $(( $(date +%s) - T0 )) -lt 500 ] || { echo "== no time left for ncu of $v"; continue; }
  IFS='|' read -r label envs bin <<< "$v"
  echo "== $label: one decode step's kernels, 26 launches after 3000"
  env $envs MOESHARD_CUDA_GRAPHS=0 timeout 60 "${NCU[@]}" --launch-skip 3000 --launch-count 26 \
    "$bin" run -m $Q -p hello -n 12 --gpu -t 16 --temp 0 2>&1 |
    awk -F'","' '/gpu__time_duration.sum/ {gsub(/"/, "", $NF); printf "%-40s %-16s %10s %s\n", substr($5, 1, 40), $9, $NF, $(NF-1)}'
done
date +%T; echo done
