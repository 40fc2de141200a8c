#!/usr/bin/env bash
# Decode deep into a context, fully on the GPU, against llama.cpp's CUDA backend, on the device
# host, one call: llama-bench built there (tools/gpu/build_llama.sh; while it builds, with
# SUITE=1, gpu_model's whole-steps test for each variant), then for ROUNDS rounds (2) on
# qwen3-30b-a3b synth, alternating: `llama-bench -p 0 -n 64 -d DEPTHS` (flash attention on
# its default, auto) and each variant's `bench --ctx-start 0 --ctx-max MAX --step STEP
# --sweep-gen 64` (the same depths: a sweep prefills to each depth and decodes 64 tokens
# there), with MOESHARD_GPU_TIMING=1's lines for one-row steps. The variants are every
# moeshard_* binary of the pack, and ENVS (extra arguments) run the first with those variables
# ("VARS@NAME": moeshard_NAME with VARS).
#
# Prepare here: PACK/bins.tar.xz with moeshard_* binaries (and gpu_model for SUITE=1),
# PACK/fixtures.tar.xz (may be an empty tar without SUITE=1), PACK/llama-src.tar.xz (as
# tools/gpu/build_llama.sh says).
# LLAMA=0 leaves llama.cpp out (no build, no llama-src.tar.xz needed).
# Run there (about 7 minutes with the build, 2 once llama-bench is built on a warm machine):
#   bash tools/gpu/depth_against_llama.sh PACK ["MOESHARD_GPU_GROUPED_DECODE=0" ...] > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
shift
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date +%T
L=/var/tmp/ll/build/bin/llama-bench
BINS=(/var/tmp/b/moeshard_*)
Q=/tmp/q30.gguf STEP=${STEP:-1024} MAX=${MAX:-4096}
DEPTHS=$(seq -s, 0 $STEP $MAX)
VARIANTS=()
for b in "${BINS[@]}"; do VARIANTS+=("|$b"); done
# An ENVS entry "VARS@NAME" runs the binary moeshard_NAME with VARS instead of the first.
for e in "$@"; do
  if [[ $e == *@* ]]; then VARIANTS+=("${e%@*}|/var/tmp/b/moeshard_${e##*@}")
  else VARIANTS+=("$e|${BINS[0]}"); fi
done
[ "${LLAMA:-1}" = 0 ] || bash "$R/tools/gpu/build_llama.sh" "$P" &
[ -s $Q ] || timeout 300 ${BINS[0]} synth --preset qwen3-30b-a3b $Q > /dev/null
cat $Q > /dev/null
if [ "${SUITE:-0}" = 1 ]; then
  for x in "${VARIANTS[@]}"; do
    IFS='|' read -r envs bin <<< "$x"
    echo "== gpu_model whole steps [$envs]"
    env $envs timeout 200 /var/tmp/b/gpu_model --nocapture --test-threads 1 whole_steps_on_the_gpu 2>&1 |
      grep -E "test result|panicked|FAILED|steps at positions|sequences at" | cut -c1-300
  done
fi
wait; date +%T
for round in $(seq ${ROUNDS:-2}); do
  if [ "${LLAMA:-1}" != 0 ]; then
    echo "== llama.cpp, round $round (depths $DEPTHS)"
    timeout 150 $L -m $Q -ngl 99 -p 0 -n 64 -d $DEPTHS -r 2 2>&1 | grep -E "tg64"
  fi
  for x in "${VARIANTS[@]}"; do
    IFS='|' read -r envs bin <<< "$x"
    echo "== $(basename $bin) [$envs], round $round (depth,prefilled,pp t/s,generated,tg t/s,KV bytes)"
    env $envs MOESHARD_GPU_TIMING=1 timeout 150 $bin bench -m $Q -t 16 --gpu --ctx-start 0 \
      --ctx-max $MAX --step $STEP --sweep-gen 64 2>&1 | grep -E "^[0-9]+,|steps of 1 row" | cut -c1-200
  done
done
date +%T
echo done
