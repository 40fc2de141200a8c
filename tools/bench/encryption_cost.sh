#!/usr/bin/env bash
# What link encryption costs end to end: `moeshard bench` over a 2-stage pipeline and a 2-rank
# tensor-parallel group on one host, keyless (--insecure) against keyed (a cluster key: Noise
# handshake, every frame sealed), alternating, each process pinned to its own cores. Usage:
#   tools/bench/encryption_cost.sh MOESHARD_BINARY MODEL.gguf THREADS_PER_PROCESS [ROUNDS]
# PP and TG set the prompt and decode lengths (default 512 and 64). Every command it runs is
# echoed first; one line per run: MODE AUTH pp=… tg=… (tokens/s, mean of 2 repetitions).
set -euo pipefail
BIN=$1; MODEL=$2; T=$3; ROUNDS=${4:-2}
PP=${PP:-512}; TG=${TG:-64}; CTX=$((PP + TG + 16))
OUT=$(mktemp -d)
KEY=$OUT/cluster.key
"$BIN" keygen "$KEY" >/dev/null
N_LAYER=$("$BIN" inspect "$MODEL" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["hyperparameters"]["block_count"])')
HALF=$((N_LAYER / 2 - 1))
cores() { echo "$(( $1 * T ))-$(( $1 * T + T - 1 ))"; }
PORT=48100
run() { echo "\$ $*" >&2; "$@"; }
one() { # one pipeline|tp keyless|keyed
  local mode=$1 auth=$2 flags
  if [ "$auth" = keyless ]; then flags=(--insecure); else flags=(--cluster-key-file "$KEY"); fi
  PORT=$((PORT + 1))
  local common=(--threads "$T" --no-warm --ctx "$CTX" "${flags[@]}")
  if [ "$mode" = pipeline ]; then
    echo "\$ taskset -c $(cores 1) $BIN worker -m $MODEL --layers $((HALF + 1)):output --coordinator 127.0.0.1:$PORT ${common[*]}" >&2
    taskset -c "$(cores 1)" "$BIN" worker -m "$MODEL" --layers "$((HALF + 1)):output" \
      --coordinator 127.0.0.1:$PORT --give-up 5 "${common[@]}" >"$OUT/worker.log" 2>&1 &
    run taskset -c "$(cores 0)" "$BIN" bench -m "$MODEL" -p "$PP" -n "$TG" -r 2 --json \
      --layers "0:$HALF" --listen 127.0.0.1:$PORT "${common[@]}" >"$OUT/run.json" 2>"$OUT/run.err"
  else
    echo "\$ taskset -c $(cores 1) $BIN worker -m $MODEL --tensor-parallel --coordinator 127.0.0.1:$PORT ${common[*]}" >&2
    taskset -c "$(cores 1)" "$BIN" worker -m "$MODEL" --tensor-parallel \
      --coordinator 127.0.0.1:$PORT --give-up 5 "${common[@]}" >"$OUT/worker.log" 2>&1 &
    run taskset -c "$(cores 0)" "$BIN" bench -m "$MODEL" -p "$PP" -n "$TG" -r 2 --json \
      --tensor-parallel --tp-size 2 --listen 127.0.0.1:$PORT "${common[@]}" >"$OUT/run.json" 2>"$OUT/run.err"
  fi
  wait || true
  python3 - "$OUT/run.json" "$mode" "$auth" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3], " ".join("%s=%.2f±%.2f" % (t["test"], t["tps_mean"], t.get("tps_stddev", 0)) for t in d["tests"]))
PY
}
for r in $(seq 1 "$ROUNDS"); do
  for mode in pipeline tp; do
    for auth in keyless keyed; do one "$mode" "$auth"; done
  done
done
