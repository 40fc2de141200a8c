#!/usr/bin/env bash
# Tensor-parallel ranks with GPUs on the device host, one call: each rank's routed experts on
# the (one, shared) GPU, the rest on its CPU (README, "--gpu"). First the qwen3moe and mixtral
# F32 fixtures: a 2-rank group with --gpu on both ranks against the single node on the CPU
# (greedy text identical, logits within 1e-3), and a group with --gpu on rank 1 only (the ranks
# must not part: the same text). Then qwen3-30b-a3b synth decode: single node on 16 threads,
# and 2 ranks of 8 threads with and without --gpu (tg64, bench's random tokens).
#
# Prepare here as for tools/gpu/hybrid_decode.sh (PACK/bins.tar.xz with moeshard_new,
# PACK/fixtures.tar.xz). Run there: bash tools/gpu/tp_gpu.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date +%T
N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf F=crates/model/tests/fixtures
( [ -s $Q ] || timeout 300 $N synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null ) &
# group CMD RANK_FLAGS THREADS COORD_FLAGS...: CMD's output on a 2-rank group (rank 1 a worker).
group() {
  local cmd=$1 rank_flags=$2 threads=$3; shift 3
  local log=/var/tmp/coord.$$ port
  $N $cmd "$@" --tensor-parallel --tp-size 2 --listen 127.0.0.1:0 --insecure -t "$threads" \
    2> $log > /var/tmp/out.$$ &
  local c=$!
  for _ in $(seq 300); do
    port=$(grep -o 'workers register at [0-9.]*:[0-9]*' $log | grep -o '[0-9]*$') && break
    kill -0 $c 2> /dev/null || break; sleep 0.2
  done
  [ -n "$port" ] && $N worker --tensor-parallel -m "$M" --coordinator 127.0.0.1:$port --insecure \
    -t "$threads" $rank_flags > /dev/null 2> /var/tmp/rank.$$ &
  local r=$!
  wait $c; local rc=$?
  kill $r 2> /dev/null; wait $r 2> /dev/null
  [ $rc = 0 ] || { echo "group failed ($rc):"; tail -5 $log; tail -5 /var/tmp/rank.$$; }
  grep -E "GPU [0-9].*rank" $log /var/tmp/rank.$$ | sed 's/^[^:]*://' | sort -u
  cat /var/tmp/out.$$
}
for fx in qwen3moe mixtral; do
  M=$F/$fx/model-f32.gguf
  want=$($N run -m $M -p The -n 32 --temp 0 --ignore-eos --kv-type f32 --no-warm 2> /dev/null)
  for flags in "--gpu|--gpu" "|--gpu"; do
    IFS='|' read -r coord_flags rank_flags <<< "$flags"
    got=$(group run "$rank_flags --kv-type f32 --no-warm" 2 -m $M -p The -n 32 --temp 0 \
      --ignore-eos --kv-type f32 --no-warm $coord_flags)
    echo "== $fx, rank 0 '${coord_flags}', rank 1 '${rank_flags}':"
    echo "$got" | grep GPU
    [ "$(echo "$got" | grep -v GPU)" = "$want" ] && echo "   same text as the single node" ||
      { echo "   TEXT DIFFERS"; echo "$got" | grep -v GPU | head -3; echo "   want:"; echo "$want" | head -3; }
  done
done
wait; date +%T
M=$Q
echo "== q30 single node, 16 threads: $($N bench -m $Q -t 16 -p 0 -n 64 -r 2 2>&1 | grep tg64)"
for flags in "" "--gpu"; do
  echo "== q30 2 ranks, 8 threads each, '${flags}': $(group bench "$flags" 8 -m $Q -p 0 -n 64 -r 2 $flags | grep -E 'tg64|GPU')"
done
date +%T
echo done
