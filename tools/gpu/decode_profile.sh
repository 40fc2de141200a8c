#!/usr/bin/env bash
# Where a GPU decode step goes, kernel by kernel, for moeshard and llama.cpp's CUDA backend on
# the same file (issue 16's decode gate: >= 1.2x llama.cpp fully on the GPU). Nsight Compute
# times each kernel of a few decode layers with the caches and clocks left alone (its default
# flushes the caches between kernels, which made memory-bound kernels look 1.5-3x slower in
# docs/measurements/2026-12-03-gpu-whole-steps.txt, run C). CUDA graphs are off for both
# engines, so the kernels are launched one by one and ncu sees each.
#
# Usage on the device host (after device_suite.sh's preparation, or with any moeshard binary,
# GGUF and llama-bench built there):
#   bash tools/gpu/decode_profile.sh MOESHARD MODEL.gguf LLAMA_BENCH [LAYERS] > $OUT/decode-profile.txt 2>&1
# LAYERS (default 2) is how many layers' kernels to list; both runs skip the prompt and the
# first decode steps, so what is listed is a steady-state decode step.
set -u
MS=$1 MODEL=$2 LLAMA=$3 LAYERS=${4:-2}
export PATH=/usr/local/cuda/bin:$PATH
NCU=(ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv)

# moeshard: a layer launches 13 kernels (docs/perf.md "Whole steps on the GPU"); skipping
# 3000 launches lands past the prompt, in the fifth decode step of a 48-layer model.
echo "== moeshard, $((13 * LAYERS)) launches after 3000"
MOESHARD_CUDA_GRAPHS=0 timeout 300 "${NCU[@]}" --launch-skip 3000 --launch-count $((13 * LAYERS)) \
  "$MS" run -m "$MODEL" -p hello -n 12 --gpu -t 16 --temp 0 2>&1 |
  awk -F'","' '/gpu__time_duration.sum/ {gsub(/"/, "", $NF); printf "%-40s %-16s %10s %s\n", substr($5, 1, 40), $9, $NF, $(NF-1)}'

# llama.cpp: its per-layer kernel count differs by build, so list 40 launches per layer asked
# and read the layer boundaries off the kernel names (rms_norm starts each half-layer).
echo "== llama.cpp, $((40 * LAYERS)) launches after 4000"
GGML_CUDA_DISABLE_GRAPHS=1 timeout 300 "${NCU[@]}" --launch-skip 4000 --launch-count $((40 * LAYERS)) \
  "$LLAMA" -m "$MODEL" -ngl 99 -p 0 -n 16 -r 1 2>&1 |
  awk -F'","' '/gpu__time_duration.sum/ {gsub(/"/, "", $NF); printf "%-40s %-16s %10s %s\n", substr($5, 1, 40), $9, $NF, $(NF-1)}'
