#!/usr/bin/env bash
# Hybrid decode on the device host, one call: the GPU suite, then qwen3-30b-a3b synth under the
# two GPU memory limits of docs/perf.md's hybrid rows (1.15GiB ≈ llama.cpp -ncmoe 48's memory,
# 9.9GiB ≈ -ncmoe 24's), alternating whole steps (decode's host experts computed by the CPU
# between the GPU's routing and its weighted sum) with the per-matrix path (`--gpu-piecewise`),
# pp512 and tg64; then one decode run under MOESHARD_GPU_TIMING=1 (where a step's time goes;
# TIMING=0 leaves it out). About 6 minutes. ROUNDS=N sets the rounds (1), MEMS the limits,
# READS the --gpu-host-read values of whole steps (auto), PIECEWISE=0 leaves the per-matrix runs out.
# VARIANTS="new:0 new:auto old+handoff:3 new+direct:0 ..." instead alternates binaries of the
# pack (moeshard_new, moeshard_old) at a --gpu-host-read each (a count or auto; with
# MOESHARD_LOG=info auto's choice is shown); +handoff runs with MOESHARD_GPU_HANDOFF=1 (for
# binaries from before the handoff became the only way, 2026-12-07), +direct with
# MOESHARD_CUDA_GRAPHS=0. SUITE=0 leaves the GPU suite out; BENCH=0 stops after it.
#
# Prepare here as for tools/gpu/hybrid_stream.sh (PACK/bins.tar.xz with moeshard_new,
# gpu_kernels, gpu_model; PACK/fixtures.tar.xz; fixtures, fuzz corpus and the demo model moved
# aside). Run there: bash tools/gpu/hybrid_decode.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; nproc
date +%T
N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf
( [ -s $Q ] || timeout 300 $N synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null ) &
[ "${BUILD_LLAMA:-0}" = 1 ] && nice -n 19 bash "$R/tools/gpu/build_llama.sh" "$P" > /var/tmp/build_llama.txt 2>&1 &
if [ "${SUITE:-1}" = 1 ]; then
  echo "== suite"
  timeout 120 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
  timeout 240 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|hybrid"
fi
wait; date +%T
[ "${BUILD_LLAMA:-0}" = 1 ] && cat /var/tmp/build_llama.txt
[ "${BENCH:-1}" = 0 ] && { echo done; exit 0; }
ms() { # label, binary, then moeshard bench arguments
  local label=$1 bin=$2; shift 2
  echo "== $label: $(timeout 120 $bin bench -m $Q -t 16 --gpu "$@" 2>&1 | grep -E 'pp512|tg64|^GPU [0-9].*routed|whole layers|host-read auto' | tr '\n' ' ')"
}
VARIANTS=${VARIANTS:-$(for r in ${READS:-auto}; do printf 'new:%s ' "$r"; done)}
# variant → "env binary read" (env "-" for none, else VAR=V,VAR=V)
unpack() {
  local name=${1%%:*} env=- part
  local bin=${name%%+*}
  for part in $(tr '+' ' ' <<< "${name#$bin}"); do
    case $part in
      direct) env=${env#-}${env:+,}MOESHARD_CUDA_GRAPHS=0 ;;
      handoff) env=${env#-}${env:+,}MOESHARD_GPU_HANDOFF=1 ;;
    esac
  done
  echo "${env#,} /var/tmp/b/moeshard_$bin ${1##*:}"
}
for round in $(seq ${ROUNDS:-1}); do
  for mem in ${MEMS:-1.15GiB 9.9GiB}; do
    for v in $VARIANTS; do
      set -- $(unpack $v); e=$1 bin=$2 read=$3
      [ "$e" = - ] && e=MOESHARD_UNUSED=1
      env $(tr ',' ' ' <<< "$e") bash -c "$(declare -f ms); Q=$Q; ms '$v --gpu-mem $mem, whole steps, --gpu-host-read $read, round $round' $bin --gpu-mem $mem --gpu-host-read $read -p 512 -n 64 -r 2"
    done
    [ "${PIECEWISE:-1}" = 1 ] && ms "--gpu-mem $mem, per-matrix (--gpu-piecewise), round $round" $N --gpu-mem $mem --gpu-piecewise -p 512 -n 64 -r 2
  done
done
date +%T
if [ "${TIMING:-1}" = 1 ]; then
  for v in $VARIANTS; do
    set -- $(unpack $v); e=$1 bin=$2 read=$3
    [ "$e" = - ] && e=MOESHARD_UNUSED=1
    e=$(tr ',' ' ' <<< "$e")
    echo "== $v: MOESHARD_GPU_TIMING=1, --gpu-mem 1.15GiB, --gpu-host-read $read, tg64"
    env $e MOESHARD_GPU_TIMING=1 timeout 100 $bin bench -m $Q -t 16 --gpu --gpu-mem 1.15GiB --gpu-host-read $read -p 16 -n 64 -r 1 2>&1 | grep -E "gpu timing|tg64" | tail -3
  done
  date +%T
fi
echo done
