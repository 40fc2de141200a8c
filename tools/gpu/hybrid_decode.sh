#!/usr/bin/env bash
# Hybrid decode on the device host, one call: the GPU suite, then qwen3-30b-a3b synth under the
# two GPU memory limits of docs/perf.md's hybrid rows (1.15GiB ≈ llama.cpp -ncmoe 48's memory,
# 9.9GiB ≈ -ncmoe 24's), alternating whole steps (decode's host experts computed by the CPU
# between the GPU's routing and its weighted sum) with the per-matrix path (`--gpu-piecewise`),
# pp512 and tg64; then one decode run under MOESHARD_GPU_TIMING=1 (where a step's time goes;
# TIMING=0 leaves it out). About 6 minutes. ROUNDS=N sets the rounds (1), MEMS the limits,
# READS the --gpu-host-read values of whole steps (0), PIECEWISE=0 leaves the per-matrix runs out.
#
# Prepare here as for tools/gpu/hybrid_stream.sh (PACK/bins.tar.xz with moeshard_new,
# gpu_kernels, gpu_model; PACK/fixtures.tar.xz; fixtures, fuzz corpus and the demo model moved
# aside). Run there: bash tools/gpu/hybrid_decode.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; nproc
date +%T
N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf
( [ -s $Q ] || timeout 150 $N synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null ) &
echo "== suite"
timeout 120 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
timeout 240 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|hybrid"
wait; date +%T
ms() { # label, then moeshard bench arguments
  local label=$1; shift
  echo "== $label: $(timeout 120 $N bench -m $Q -t 16 --gpu "$@" 2>&1 | grep -E 'pp512|tg64|^GPU [0-9].*routed|whole layers' | tr '\n' ' ')"
}
for round in $(seq ${ROUNDS:-1}); do
  for mem in ${MEMS:-1.15GiB 9.9GiB}; do
    for read in ${READS:-0}; do
      ms "--gpu-mem $mem, whole steps, --gpu-host-read $read, round $round" --gpu-mem $mem --gpu-host-read $read -p 512 -n 64 -r 2
    done
    [ "${PIECEWISE:-1}" = 1 ] && ms "--gpu-mem $mem, per-matrix (--gpu-piecewise), round $round" --gpu-mem $mem --gpu-piecewise -p 512 -n 64 -r 2
  done
done
date +%T
if [ "${TIMING:-1}" = 1 ]; then
  for read in ${READS:-0}; do
    echo "== MOESHARD_GPU_TIMING=1, --gpu-mem 1.15GiB, --gpu-host-read $read, tg64"
    MOESHARD_GPU_TIMING=1 timeout 100 $N bench -m $Q -t 16 --gpu --gpu-mem 1.15GiB --gpu-host-read $read -p 16 -n 64 -r 1 2>&1 | grep -E "gpu timing|tg64" | tail -3
  done
  date +%T
fi
echo done
