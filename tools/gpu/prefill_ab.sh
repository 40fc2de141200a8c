#!/usr/bin/env bash
# GPU prefill A/B on the device host in one call: pp512/tg128 of two moeshard binaries
# alternating (qwen3-30b-a3b synth), their greedy texts, then every launch of the new binary's
# 512-row step with its time and grid (ncu; launches 3000.. skip most of `bench`'s warm-up, a
# 512-row step and four decode rows, whose kernels an earlier profile mistook for the 512-row
# step's: pick the step's launches out by their grids), and
# the matmul/attention launches' speed-of-light sections. How the 2026-12-06 prefill work was
# measured (docs/measurements/2026-12-06-h100-gpu-prefill-step.txt).
#
# Prepare here: strip the two release binaries into PACK/bins.tar.xz as moeshard_main and
# moeshard_new (tools/gpu/suite.sh adds gpu_kernels and gpu_model from `cargo test --release
# -p gpu --no-run`); carry PACK (see tools/gpu/decode_ab.sh for the 64 MiB limit).
# Run there: bash tools/gpu/prefill_ab.sh PACK > $OUT/run.txt 2>&1 (writes $OUT/ncu512*.csv/txt)
set -x
P=$(cd "$1" && pwd)
export PATH=/usr/local/cuda/bin:$PATH
mkdir -p /var/tmp/b && tar xJf "$P/bins.tar.xz" -C /var/tmp/b
M=/var/tmp/b/moeshard_main N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nproc; date +%T
[ -s $Q ] || timeout 150 $N synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null; date +%T
for r in 1 2; do for b in $M $N; do echo "== $b round $r"
  MOESHARD_GPU_TIMING=1 timeout 90 $b bench -m $Q -t 16 --gpu -p 512 -n 128 -r 3 2>&1 | grep -E "pp512|tg128|gpu timing"; done; done
for b in $M $N; do timeout 60 $b run -m $Q -p "The river" -n 32 --gpu -t 16 --temp 0 2>/dev/null | md5sum; done
date +%T
NCU=(ncu --cache-control none --clock-control none)
MOESHARD_CUDA_GRAPHS=0 timeout 240 "${NCU[@]}" --metrics gpu__time_duration.sum --csv --launch-skip 3000 --launch-count 2000 \
  $N bench -m $Q -t 16 --gpu -p 512 -n 0 -r 1 > $OUT/ncu512.csv 2>&1
date +%T
MOESHARD_CUDA_GRAPHS=0 timeout 100 "${NCU[@]}" --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  --kernel-name regex:'matmul_mma|matmul_grouped|attention_grouped' --launch-skip 400 --launch-count 8 \
  $N bench -m $Q -t 16 --gpu -p 512 -n 0 -r 1 > $OUT/ncu512_sol.txt 2>&1
date +%T; echo done
