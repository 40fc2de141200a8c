#!/usr/bin/env bash
# Pipeline and tensor-parallel measurements on one many-core host, each process pinned to its
# own cores (an approximation of separate machines on loopback). Usage:
#   tools/bench/cluster_bench.sh MOESHARD_BINARY MODEL.gguf THREADS_PER_PROCESS [OUT_DIR]
# ONLY=pipeline|tp runs one half; PP and TG set the prompt and decode lengths; PIPE_CONFIGS lists
# CHUNK:WINDOW pairs for the pipeline runs (default "256:1 256:4"), MAX_TP the largest group
# (default 3), TP_MODES the expert placements (default "owned balanced placed"; placed
# records a routing profile on the text file PROFILE_TEXT — default: tools/bench/
# code_edit_prompt.txt — then `moeshard plan --expert-replicas $REPLICAS`, default 25%). Every command it
# runs is echoed first.
set -euo pipefail
BIN=$1; MODEL=$2; T=$3; OUT=${4:-/tmp/cluster-bench}
mkdir -p "$OUT"
N_LAYER=$("$BIN" inspect "$MODEL" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["hyperparameters"]["block_count"])')
HALF=$((N_LAYER / 2 - 1))
cores() { echo "$(( $1 * T ))-$(( $1 * T + T - 1 ))"; }
PORT=47900
run() { echo "\$ $*" >&2; "$@"; }
bench() { # bench NAME CORESET ARGS...
  local name=$1 set=$2; shift 2
  run taskset -c "$set" "$BIN" bench -m "$MODEL" --threads "$T" --no-warm --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  python3 - "$OUT/$name.json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
tests = " ".join("%s=%.2f" % (t["test"], t["tps_mean"]) for t in d["tests"])
stats = " ".join("%s=%.1f" % (k, v) for k, v in d["stats"].items() if k.startswith("tp_"))
print(sys.argv[2], tests, stats)
PY
}
worker() { # worker CORESET ARGS...
  local set=$1; shift
  echo "\$ taskset -c $set $BIN worker -m $MODEL --threads $T --no-warm $*" >&2
  taskset -c "$set" "$BIN" worker -m "$MODEL" --threads "$T" --no-warm --give-up 5 "$@" > "$OUT/worker-$RANDOM.log" 2>&1 &
}
PP=${PP:-4096}; TG=${TG:-64}; CTX=$((PP + TG + 16))
ONLY=${ONLY:-all}
if [ "$ONLY" != tp ]; then
echo "## pipeline: $PP-token prefill and $TG-token decode, $T threads per process"
bench single "$(cores 0)" -p "$PP" -n "$TG" -r 1 --ctx "$CTX"
# CHUNK:WINDOW pairs; a window of 1 is the no-overlap baseline.
for cw in ${PIPE_CONFIGS:-256:1 256:4}; do
  chunk=${cw%%:*}; window=${cw##*:}
  PORT=$((PORT + 1))
  worker "$(cores 1)" --layers "$((HALF + 1)):output" --coordinator 127.0.0.1:$PORT --insecure --ctx "$CTX"
  bench "pipe2-chunk$chunk-window$window" "$(cores 0)" -p "$PP" -n "$TG" -r 1 --ctx "$CTX" --layers "0:$HALF" --listen 127.0.0.1:$PORT --insecure \
    --dist-prefill-chunk "$chunk" --dist-prefill-window "$window"
  wait || true
done
fi
if [ "$ONLY" != pipeline ]; then
echo "## tensor parallel: decode $TG tokens, $T threads per rank"
bench tp1 "$(cores 0)" -p 0 -n "$TG" -r 2
MODES=${TP_MODES:-owned balanced placed}
if [[ " $MODES " == *" placed "* ]]; then
  TEXT=${PROFILE_TEXT:-$(dirname "$0")/code_edit_prompt.txt}
  run taskset -c "$(cores 0)" "$BIN" run -m "$MODEL" --threads "$T" --no-warm -p "$(cat "$TEXT")" -n 64 --temp 0 \
    --ssd-streaming --save-expert-profile "$OUT/routing.profile" > "$OUT/profile-run.txt" 2> "$OUT/profile-run.err"
  for n in $(seq 2 "${MAX_TP:-3}"); do
    run "$BIN" plan -m "$MODEL" --expert-profile "$OUT/routing.profile" --tp-size "$n" \
      --expert-replicas "${REPLICAS:-25%}" -o "$OUT/placement-$n.txt" | tee "$OUT/plan-$n.txt"
  done
fi
for mode in $MODES; do
for n in $(seq 2 "${MAX_TP:-3}"); do
  PORT=$((PORT + 1))
  flags=(); [ "$mode" = balanced ] && flags=(--tp-balance-experts)
  [ "$mode" = placed ] && flags=(--expert-placement "$OUT/placement-$n.txt")
  for r in $(seq 1 $((n - 1))); do worker "$(cores "$r")" --tensor-parallel --coordinator 127.0.0.1:$PORT --insecure; done
  bench "tp$n-$mode" "$(cores 0)" -p 0 -n "$TG" -r 2 --tensor-parallel --tp-size "$n" --listen 127.0.0.1:$PORT --insecure "${flags[@]}"
  wait || true
done
done
fi
