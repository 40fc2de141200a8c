#!/usr/bin/env bash
# Decode at a long context on the device host, one call: gpu_model (every whole-step check,
# with one-row steps at positions 650-659 against the CPU), then qwen3-30b-a3b synth fully on
# the GPU, moeshard_old against moeshard_new for ROUNDS rounds (1): `run` decoding 128 tokens
# after PACK/eval_prompt.txt (2843 tokens) with MOESHARD_GPU_TIMING=1, and `bench -p 0 -n 128`
# (decode from position 0). SUITE_FILTER=NAME runs only gpu_model tests of that name.
#
# Prepare here as for tools/gpu/hybrid_decode.sh (PACK/bins.tar.xz with moeshard_new,
# moeshard_old, gpu_model; PACK/fixtures.tar.xz; PACK/eval_prompt.txt). Run there:
#   bash tools/gpu/long_decode.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date +%T
Q=/tmp/q30.gguf
( [ -s $Q ] || timeout 300 /var/tmp/b/moeshard_new synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null ) &
echo "== gpu_model"
timeout ${SUITE_TIMEOUT:-200} /var/tmp/b/gpu_model --nocapture --test-threads 1 $SUITE_FILTER 2>&1 |
  grep -E "test result|panicked|FAILED|positions 650" | cut -c1-300
wait; date +%T
for round in $(seq ${ROUNDS:-1}); do
  for b in old new; do
    N=/var/tmp/b/moeshard_$b
    echo "== $b, round $round: after 2843 tokens: $(MOESHARD_GPU_TIMING=1 timeout 100 $N run -m $Q -t 16 --gpu \
      -p "$(cat "$P/eval_prompt.txt")" -n 128 --temp 0 --ignore-eos 2> /var/tmp/err.$b > /var/tmp/text.$b;
      grep -E 'generation:|steps of 1 row' /var/tmp/err.$b | tail -2 | tr '\n' ' ')"
    echo "   from position 0: $(timeout 100 $N bench -m $Q -t 16 --gpu -p 0 -n 128 -r 2 2>&1 | grep tg128)"
  done
  cmp -s /var/tmp/text.old /var/tmp/text.new && echo "   same text" ||
    echo "   texts differ from byte $(cmp /var/tmp/text.old /var/tmp/text.new | grep -o 'byte [0-9]*')"
done
date +%T
echo done
