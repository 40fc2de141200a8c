#!/usr/bin/env bash
# Decode scaling on one 16-core host, one sitting: tensor parallel at 2 and 3 ranks × 5 threads
# with owned, balanced and profile-placed experts (+25 % / +50 % replicas), batched decode at
# 16 threads (1, 4, 8 sessions), speculative decoding in a 2-stage pipeline. Usage:
#   tools/bench/decode_scaling.sh MOESHARD_BINARY MODEL.gguf ROUTING.profile
# (the profile: `moeshard run -m MODEL --ssd-streaming --save-expert-profile FILE -p "$(cat
# tools/bench/code_edit_prompt.txt)" -n 64 --temp 0`). docs/perf.md has its numbers.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=$1; M=$2; PROFILE=$3
for n in 2 3; do for r in 25% 50%; do
  $B plan -m $M --expert-profile $PROFILE --tp-size $n --expert-replicas $r -o /tmp/pl-$n-$r.txt | tail -4
done; done
js() { python3 -c 'import json,sys; d=json.load(sys.stdin); print(sys.argv[1], " ".join("%s=%.2f±%.2f"%(t["test"],t["tps_mean"],t.get("tps_stddev",t.get("tps_sd",0)) or 0) for t in d["tests"]), " ".join("%s=%.1f"%(k,v) for k,v in d["stats"].items() if k.startswith("tp_ex")))' "$1"; }
taskset -c 0-4 $B bench -m $M -t 5 -p 0 -n 64 -r 3 --no-warm --json 2>/dev/null | js tp1
P=47800
for n in 2 3; do for mode in owned balanced placed25 placed50 balanced placed25; do
  P=$((P+1)); flags=()
  case $mode in balanced) flags=(--tp-balance-experts);; placed25) flags=(--expert-placement /tmp/pl-$n-25%.txt);; placed50) flags=(--expert-placement /tmp/pl-$n-50%.txt);; esac
  for r in $(seq 1 $((n-1))); do taskset -c $((r*5))-$((r*5+4)) $B worker -m $M -t 5 --no-warm --tensor-parallel --coordinator 127.0.0.1:$P --insecure --give-up 5 > /tmp/w$r.log 2>&1 & done
  taskset -c 0-4 $B bench -m $M -t 5 -p 0 -n 64 -r 3 --no-warm --json --tensor-parallel --tp-size $n --listen 127.0.0.1:$P --insecure "${flags[@]}" 2>/dev/null | js "tp$n-$mode"
  wait
done; done
for p in 1 4 8; do $B bench -m $M -t 16 -p 0 -n 64 -r 3 --parallel $p --json 2>/dev/null | js "batched-$p"; done
for s in off prompt-lookup; do
  P=$((P+1))
  taskset -c 8-15 $B worker -m $M -t 8 --no-warm --layers 8:output --coordinator 127.0.0.1:$P --insecure --give-up 5 > /tmp/wp.log 2>&1 &
  taskset -c 0-7 $B bench -m $M -t 8 --no-warm -p 0 -n 128 -r 2 --layers 0:7 --listen 127.0.0.1:$P --insecure --speculative $s --prompt-file tools/bench/code_edit_prompt.txt 2>&1 | grep -E "tg|accept|draft" | tail -4
  wait
done
