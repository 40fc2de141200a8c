#!/usr/bin/env bash
# Prefill of one binary under experiment switches (ENV=VALUE sets, comma-separated within a
# set), against a baseline binary, alternating, on the device host: pp512 (qwen3-30b-a3b synth,
# -r 3, two rounds), each variant's greedy text, and its tensor-core launches' times under ncu.
# Also the GPU suite of the tree under each set (PACK/bins.tar.xz: moeshard_main, moeshard_new,
# gpu_kernels, gpu_model; PACK/fixtures.tar.xz as for tools/gpu/suite.sh).
# Run there: [BUILT_AT=/work/tree] bash tools/gpu/prefill_variants.sh PACK 'A=1' 'A=1,B=2' ... > $OUT/run.txt 2>&1
R=$PWD; P=$(cd "$1" && pwd); shift
# The test binaries look for fixtures under the absolute path of the tree they were built in
# (BUILT_AT; a worktree's path, say).
B=${BUILT_AT:-/work/main}; mkdir -p "$(dirname "$B")" && { [ -e "$B" ] || ln -s "$R" "$B"; }
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p crates/model/tests/fixtures && tar xJf "$P/fixtures.tar.xz" -C crates/model/tests/fixtures
mkdir -p /var/tmp/b && tar xJf "$P/bins.tar.xz" -C /var/tmp/b
M=/var/tmp/b/moeshard_main N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf
nvidia-smi --query-gpu=name,memory.total --format=csv; date +%T
( [ -s $Q ] || timeout 150 $N synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null ) &
for v in "" "$@"; do
  echo "== suite under '${v}'"
  env ${v//,/ } timeout 100 /var/tmp/b/gpu_model --test-threads 1 2>&1 | grep -E "test result|panicked"
done
wait; date +%T
VARIANTS=("main||$M" "new||$N")
for v in "$@"; do VARIANTS+=("new $v|${v//,/ }|$N"); done
for round in 1 2; do
  for x in "${VARIANTS[@]}"; do
    IFS='|' read -r label envs bin <<< "$x"
    echo "== $label, round $round: $(env $envs timeout 60 "$bin" bench -m $Q -t 16 --gpu -p 512 -n 0 -r 3 2>&1 | grep pp512)"
  done
done
date +%T
for x in "${VARIANTS[@]}"; do
  IFS='|' read -r label envs bin <<< "$x"
  echo "== $label greedy: $(env $envs timeout 60 "$bin" run -m $Q -p 'The river' -n 32 --gpu -t 16 --temp 0 2>/dev/null | md5sum)"
  env $envs MOESHARD_CUDA_GRAPHS=0 timeout 60 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \
    --kernel-name matmul_mma --launch-skip 192 --launch-count 8 "$bin" bench -m $Q -t 16 --gpu -p 512 -n 0 -r 1 2>&1 |
    awk -F'","' '/gpu__time_duration.sum/ {gsub(/"/, "", $NF); printf "   %-12s %-14s %10s %s\n", substr($5, 1, 12), $9, $NF, $(NF-1)}'
done
date +%T; echo done
