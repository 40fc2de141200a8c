#!/usr/bin/env bash
# Hybrid placement on the device host, one call: the GPU suite (its hybrid tests copy experts
# left on the host in per step: per matrix product, and per layer in whole steps), then
# qwen3-30b-a3b synth prompts under two GPU memory limits, two rounds alternating: no copies
# (`--gpu-stream-min 0`), whole steps with each layer's host experts copied in (the default),
# the per-matrix path's copies (`--gpu-piecewise`), and the host pages left unlocked
# (`MOESHARD_GPU_LOCK_HOST=0`: whole steps decline, the per-matrix path's copies are staged);
# then one `--profile`d run. About 2.5 minutes.
# SUITE=0 leaves the GPU suite out, SWEEP=0 the sweep and the profile; ROUNDS=N sets the rounds against llama.cpp (2).
# With LLAMA=1, llama.cpp's CUDA backend is then built there from the sdist's source (after the
# sweep: a build beside it takes the 16 cores the CPU side needs) and run at the `-ncmoe`
# placements that use the same GPU memory, alternating with moeshard (pp512, tg64; GPU memory
# the most `nvidia-smi` shows every 0.3 s), moeshard at each `--gpu-host-read` of READS (auto).
# About 8.5 minutes.
#
# Prepare here as for tools/gpu/against_llama.sh (PACK/bins.tar.xz with moeshard_new,
# gpu_kernels, gpu_model; PACK/fixtures.tar.xz; PACK/llama-src.tar.xz for LLAMA=1; fixtures,
# fuzz corpus and the demo model moved aside). Run there:
#   [LLAMA=1] bash tools/gpu/hybrid_stream.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
export PATH=/usr/local/cuda/bin:/opt/torch/.venv/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; nproc
grep MemAvailable /proc/meminfo; date +%T
L=/var/tmp/ll/build/bin/llama-bench N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf
[ -s $Q ] || timeout 120 $N synth --preset qwen3-30b-a3b $Q > /dev/null
cat $Q > /dev/null
if [ "${SUITE:-1}" = 1 ]; then
  echo "== suite"
  timeout 120 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
  timeout 200 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|hybrid|whole steps"
fi
date +%T
# peak MEMFILE CMD...: runs CMD with nvidia-smi sampled beside it; prints the peak MiB.
peak() {
  local f=$1; shift
  ( while sleep 0.3; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done > "$f" ) &
  local s=$!
  "$@"
  kill $s; wait $s 2> /dev/null
  echo "max GPU MiB: $(sort -n "$f" | tail -1)"
}
ms() { # label, then moeshard bench arguments
  local label=$1; shift
  echo "== $label: $(peak /var/tmp/mem_ms timeout 120 $N bench -m $Q -t 16 --gpu "$@" 2>&1 | grep -E 'pp512|tg64|GPU MiB|^GPU [0-9].*routed|whole layers|at a time' | tr '\n' ' ')"
}
for round in 1 2; do
  [ "${SWEEP:-1}" = 1 ] || break
  for mem in 1.15GiB 9.9GiB; do
    ms "--gpu-mem $mem, no copies, round $round" --gpu-mem $mem --gpu-stream-min 0 -p 512 -n 0 -r 3
    ms "--gpu-mem $mem, whole steps, layers copied in, round $round" --gpu-mem $mem -p 512 -n 0 -r 3
    ms "--gpu-mem $mem, per-matrix copies (--gpu-piecewise), round $round" --gpu-mem $mem --gpu-piecewise -p 512 -n 0 -r 3
    MOESHARD_GPU_LOCK_HOST=0 ms "--gpu-mem $mem, host pages unlocked (per-matrix, staged copies), round $round" --gpu-mem $mem -p 512 -n 0 -r 3
  done
done
date +%T
[ "${SWEEP:-1}" = 1 ] && timeout 100 $N bench -m $Q -t 16 --gpu --gpu-mem 1.15GiB -p 512 -n 0 -r 3 --profile 2>&1 | grep -v INFO | tail -32
date +%T
[ -n "${LLAMA:-}" ] || { echo done; exit 0; }
bash "$R/tools/gpu/build_llama.sh" "$P"
for round in $(seq ${ROUNDS:-2}); do
  # Each llama.cpp placement, then moeshard at the limits around the GPU memory it used
  # (moeshard's device scratch and caches lie outside --gpu-mem).
  for x in "24|9.9GiB 9.0GiB" "47|" "48|1.15GiB"; do
    IFS='|' read -r nc mems <<< "$x"
    echo "== llama.cpp -ncmoe $nc, round $round"
    peak /var/tmp/mem_ll timeout 100 $L -m $Q -ngl 99 -ncmoe $nc -t 16 -p 512 -n 64 -r 2 2>&1 | grep -E "pp512|tg64|GPU MiB"
    for mem in $mems; do
      for read in ${READS:-auto}; do
        ms "--gpu-mem $mem, --gpu-host-read $read, round $round" --gpu-mem $mem --gpu-host-read $read -p 512 -n 64 -r 2
      done
    done
  done
done
date +%T
echo done
