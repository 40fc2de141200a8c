#!/usr/bin/env bash
# Decode deep into a context, fully on the GPU, against llama.cpp's CUDA backend, on the device
# host, one call: llama-bench built there (tools/gpu/build_llama.sh), then for ROUNDS rounds (2)
# on qwen3-30b-a3b synth, alternating: `llama-bench -p 0 -n 64 -d DEPTHS` (flash attention on,
# its default auto) and each moeshard_* binary's `bench --ctx-start 0 --ctx-max MAX --step STEP
# --sweep-gen 64` (the same depths: a sweep prefills to each depth and decodes 64 tokens there).
#
# Prepare here: PACK/bins.tar.xz with moeshard_* binaries, PACK/fixtures.tar.xz (may be an empty
# tar: nothing here reads fixtures), PACK/llama-src.tar.xz (as tools/gpu/build_llama.sh says).
# Run there (about 7 minutes with the build, 2 once llama-bench is built on a warm machine):
#   bash tools/gpu/depth_against_llama.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date +%T
L=/var/tmp/ll/build/bin/llama-bench
BINS=(/var/tmp/b/moeshard_*)
Q=/tmp/q30.gguf STEP=${STEP:-1024} MAX=${MAX:-4096}
DEPTHS=$(seq -s, 0 $STEP $MAX)
bash "$R/tools/gpu/build_llama.sh" "$P" &
[ -s $Q ] || timeout 300 ${BINS[0]} synth --preset qwen3-30b-a3b $Q > /dev/null
cat $Q > /dev/null
wait; date +%T
for round in $(seq ${ROUNDS:-2}); do
  echo "== llama.cpp, round $round (depths $DEPTHS)"
  timeout 150 $L -m $Q -ngl 99 -p 0 -n 64 -d $DEPTHS -r 2 2>&1 | grep -E "tg64"
  for b in "${BINS[@]}"; do
    echo "== $(basename $b), round $round (depth,prefilled,pp t/s,generated,tg t/s,KV bytes)"
    timeout 150 $b bench -m $Q -t 16 --gpu --ctx-start 0 --ctx-max $MAX --step $STEP \
      --sweep-gen 64 2>&1 | grep -E "^[0-9]+,"
  done
done
date +%T
echo done
