#!/usr/bin/env bash
# One sitting on the device host: the GPU suite of a tree, moeshard binaries alternating on
# qwen3-30b-a3b synth (pp512/tg128 with MOESHARD_GPU_TIMING, greedy text), llama.cpp's CUDA
# backend built there from the sdist's source and benchmarked alternating with the first
# binary, then hybrid placement against `-ncmoe`. How docs/measurements/2026-12-06-h100-gpu-
# launch-overlap.txt was measured (there in several calls; this is them in one).
#
# Prepare here:
#   PACK/bins.tar.xz      stripped `moeshard` release binaries named moeshard_*, plus gpu_kernels
#                         and gpu_model from `cargo test --release -p gpu --no-run`
#   PACK/fixtures.tar.xz  tar of crates/model/tests/fixtures/{qwen3moe,llama}
#   PACK/llama-src.tar.xz llama.cpp's source (tools/gpu/build_llama.sh says what it must hold)
# and move crates/model/tests/fixtures, fuzz/corpus and models/shakespeare-moe.gguf aside so the
# tree plus PACK stays under the 64 MiB a call carries.
# Run there (one call, about 9 minutes; ENVS are extra variants of the first binary):
#   bash tools/gpu/against_llama.sh PACK ["MOESHARD_GPU_PDL=0 MOESHARD_GPU_PREFETCH=0" ...] > $OUT/run.txt 2>&1
# Each variant's kernel tests and whole steps run again under its switches while llama.cpp builds.
# With QUICK=1 only the build and the alternating pp512/tg128 rounds run (no suite, fixtures,
# greedy text or hybrid): about 5 minutes, what a session's last few device minutes allow
# (docs/measurements/2026-12-06-h100-gpu-decode-q6k-words.txt, call 7).
# Do not wrap it in `exec > >(tee ...)`: the `wait` below would wait for tee too.
R=$PWD; P=$(cd "$1" && pwd); shift
mkdir -p /work && { [ -e /work/main ] || ln -s "$R" /work/main; }
export PATH=/usr/local/cuda/bin:/opt/torch/.venv/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -n "${QUICK:-}" ] || { mkdir -p crates/model/tests/fixtures && tar xJf "$P/fixtures.tar.xz" -C crates/model/tests/fixtures; }
mkdir -p /var/tmp/b && tar xJf "$P/bins.tar.xz" -C /var/tmp/b
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; nproc; date +%T
L=/var/tmp/ll/build/bin/llama-bench
bash "$R/tools/gpu/build_llama.sh" "$P" &
BINS=(/var/tmp/b/moeshard_*)
N=${BINS[0]} Q=/tmp/q30.gguf
[ -s $Q ] || timeout 120 $N synth --preset qwen3-30b-a3b $Q > /dev/null
cat $Q > /dev/null
if [ -z "${QUICK:-}" ]; then
  echo "== suite"
  timeout 200 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
  timeout 200 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|max \|gpu"
  # The kernel tests and whole steps again under each variant's switches, while llama.cpp builds.
  bash "$R/tools/gpu/variant_suite.sh" "$@"
fi
date +%T
wait
date +%T
VARIANTS=()
for b in "${BINS[@]}"; do VARIANTS+=("|$b"); done
for e in "$@"; do VARIANTS+=("$e|$N"); done
for round in 1 2; do
  echo "== llama.cpp round $round"
  timeout 90 $L -m $Q -ngl 99 -p 512 -n 128 -r 3 2>&1 | grep -E "pp512|tg128"
  for x in "${VARIANTS[@]}"; do
    IFS='|' read -r envs bin <<< "$x"
    echo "== $(basename $bin) [$envs] round $round: $(env $envs MOESHARD_GPU_TIMING=1 timeout 70 $bin bench -m $Q -t 16 --gpu -p 512 -n 128 -r 3 2>&1 | grep -E "pp512|tg128|388 steps of 1 row|512 rows" | sort -u | tr '\n' ' ')"
  done
done
[ -n "${QUICK:-}" ] && { date +%T; echo done; exit 0; }
for x in "${VARIANTS[@]}"; do
  IFS='|' read -r envs bin <<< "$x"
  echo "== greedy $(basename $bin) [$envs]: $(env $envs timeout 40 $bin run -m $Q -p 'The river' -n 32 --gpu -t 16 --temp 0 2>/dev/null | md5sum)"
done
date +%T
for x in "24|9.9GiB" "48|1.15GiB"; do
  IFS='|' read -r nc mem <<< "$x"
  ( while sleep 0.3; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done > /var/tmp/mem_ll_$nc ) &
  S=$!
  timeout 100 $L -m $Q -ngl 99 -ncmoe $nc -t 16 -p 512 -n 64 -r 2 2>&1 | grep -E "pp512|tg64"
  kill $S
  echo "llama.cpp -ncmoe $nc max GPU MiB: $(sort -n /var/tmp/mem_ll_$nc | tail -1)"
  ( while sleep 0.3; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done > /var/tmp/mem_ms_$nc ) &
  S=$!
  echo "== $(basename $N) --gpu-mem $mem: $(timeout 100 $N bench -m $Q -t 16 --gpu --gpu-mem $mem -p 512 -n 64 -r 2 2>&1 | grep -E 'pp512|tg64' | tr '\n' ' ')"
  kill $S
  echo "moeshard --gpu-mem $mem max GPU MiB: $(sort -n /var/tmp/mem_ms_$nc | tail -1)"
done
date +%T
echo done
