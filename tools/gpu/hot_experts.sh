#!/usr/bin/env bash
# Routed experts placed on the GPU by a routing profile (`--expert-profile`, hottest first)
# against layer by layer, on the device host, one call. qwen3-30b-a3b synth: a profile recorded
# on tools/bench/code_edit_prompt.txt plus 64 generated tokens (the CPU, streaming; PACK/q30.profile
# if the pack has one), then
# at each of MEMS (3GiB 9.9GiB), layered and profiled alternating for ROUNDS rounds (2),
# --gpu-host-read auto: `run` decoding 128 tokens of another text (PACK/eval_prompt.txt, or the
# profile's own), whose GPU line says which share of the profile's routes reach GPU experts
# either way, and `bench -p 512 -n 64 -r 2` (random tokens). SUITE=1 runs the GPU suite first
# (SUITE_FILTER=NAME: gpu_model's tests of that name only).
#
# Prepare here as for tools/gpu/hybrid_decode.sh (PACK/bins.tar.xz with moeshard_new, and
# gpu_kernels and gpu_model for SUITE=1; PACK/fixtures.tar.xz). Run there:
#   bash tools/gpu/hot_experts.sh PACK > $OUT/run.txt 2>&1
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date +%T
N=/var/tmp/b/moeshard_new Q=/tmp/q30.gguf PROFILE=/tmp/q30.profile
( [ -s $Q ] || timeout 300 $N synth --preset qwen3-30b-a3b $Q > /dev/null; cat $Q > /dev/null ) &
if [ "${SUITE:-0}" = 1 ]; then
  echo "== suite"
  [ -z "$SUITE_FILTER" ] &&
    timeout 120 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
  timeout ${SUITE_TIMEOUT:-300} /var/tmp/b/gpu_model --nocapture --test-threads 1 $SUITE_FILTER 2>&1 |
    grep -E "test result|panicked|FAILED|hottest" | cut -c1-300
fi
wait; date +%T
# The profile recorded elsewhere on the same synth file (synth is deterministic) when the pack
# has one, else here.
if [ -s "$P/q30.profile" ]; then
  cp "$P/q30.profile" $PROFILE
else
  rm -f $PROFILE
  timeout 200 $N run -m $Q -t 16 --ssd-streaming --save-expert-profile $PROFILE \
    -p "$(cat "$R/tools/bench/code_edit_prompt.txt")" -n 64 --temp 0 > /dev/null 2> /var/tmp/profile.err ||
    tail -3 /var/tmp/profile.err
fi
echo "== profile: $(sed -n 4p $PROFILE), $(($(wc -l < $PROFILE) - 4)) (layer, expert) pairs routed"
date +%T
# Decode of a text the profile was not recorded on (PACK/eval_prompt.txt when the pack has one:
# the profile then comes from PACK/profile_prompt.txt), and bench's pp512/tg64.
EVAL="$R/tools/bench/code_edit_prompt.txt"; [ -s "$P/eval_prompt.txt" ] && EVAL="$P/eval_prompt.txt"
for round in $(seq ${ROUNDS:-2}); do
  for mem in ${MEMS:-3GiB 9.9GiB}; do
    for how in layered profiled; do
      extra=; [ $how = profiled ] && extra="--expert-profile $PROFILE"
      echo "== $how, --gpu-mem $mem, round $round: $(timeout 150 $N run -m $Q -t 16 --gpu \
        --gpu-mem $mem $extra -p "$(cat "$EVAL")" -n 128 --temp 0 --ignore-eos 2>&1 > /dev/null |
        grep -E '^GPU [0-9].*routed|generation:' | sed 's/.*routed experts/routed experts/' | tr '\n' ' ')"
      echo "   bench: $(timeout 150 $N bench -m $Q -t 16 --gpu --gpu-mem $mem $extra -p 512 -n 64 \
        -r 2 2>&1 | grep -E 'pp512|tg64' | tr '\n' ' ')"
    done
  done
done
date +%T
echo done
