#!/usr/bin/env bash
# Fuzzing with cargo-fuzz (libFuzzer): installs cargo-fuzz when missing, builds every target in
# fuzz/fuzz_targets, runs each (or the ones named) for a number of executions spread over
# libFuzzer workers, keeps crashes in fuzz/artifacts/<target>/ and prints a summary table.
# See fuzz/README.md.
#
#   scripts/fuzz.sh [options] [TARGET...]
#     -n RUNS     executions per target, all workers together (default 10000000; env FUZZ_RUNS)
#     -j JOBS     libFuzzer -jobs and -workers (default: the number of cores; env FUZZ_JOBS)
#     -T SECONDS  also stop each target after this many seconds (libFuzzer -max_total_time)
#     -t SECONDS  per-input timeout, a hang above it is an artifact (default 10)
#     --cmin      afterwards, merge what the run found into fuzz/corpus/<target> (cargo fuzz cmin)
#     --seeds     first regenerate the seed inputs (fuzz/examples/make_seeds.rs: real GGUFs,
#                 snapshots, cache files, request bodies) and merge those that add coverage into
#                 fuzz/corpus/<target>; use after a format change, then --cmin
#     --build     build only
#     --list      print the targets and exit
#
# New inputs go to fuzz/work/<target>/corpus (ignored by git); the committed seeds in
# fuzz/corpus/<target> are read, never written, unless --cmin is given. Exit status: 0 when no
# target left a crash, hang or out-of-memory artifact, 1 otherwise, 2 on a usage or build error.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
fuzz="$root/fuzz"
cd "$root"

runs=${FUZZ_RUNS:-10000000}
jobs=${FUZZ_JOBS:-$(nproc)}
timeout=10
max_time=0
cmin=0
seeds=0
build_only=0
list_only=0
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
    -n) runs=$2; shift 2 ;;
    -j) jobs=$2; shift 2 ;;
    -T) max_time=$2; shift 2 ;;
    -t) timeout=$2; shift 2 ;;
    --cmin) cmin=1; shift ;;
    --seeds) seeds=1; shift ;;
    --build) build_only=1; shift ;;
    --list) list_only=1; shift ;;
    -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
    esac
done

# Every fuzz_targets/*.rs is a target; each needs its [[bin]] in fuzz/Cargo.toml.
all=()
for f in "$fuzz"/fuzz_targets/*.rs; do
    t=$(basename "$f" .rs)
    if ! grep -q "^name = \"$t\"" "$fuzz/Cargo.toml"; then
        echo "fuzz.sh: fuzz_targets/$t.rs has no [[bin]] name = \"$t\" in fuzz/Cargo.toml" >&2
        exit 2
    fi
    all+=("$t")
done
if [ "$list_only" = 1 ]; then
    printf '%s\n' "${all[@]}"
    exit 0
fi
if [ ${#targets[@]} -eq 0 ]; then
    targets=("${all[@]}")
fi
for t in "${targets[@]}"; do
    if [ ! -f "$fuzz/fuzz_targets/$t.rs" ]; then
        echo "fuzz.sh: no target $t (targets: ${all[*]})" >&2
        exit 2
    fi
done

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz from crates.io" >&2
    cargo install cargo-fuzz --locked
fi

# One build of every target (they share the instrumented dependencies): release with debug
# assertions and AddressSanitizer, cargo-fuzz's defaults.
if [ ${#targets[@]} -eq ${#all[@]} ]; then
    cargo +nightly fuzz build --fuzz-dir "$fuzz" || exit 2
else
    for t in "${targets[@]}"; do
        cargo +nightly fuzz build --fuzz-dir "$fuzz" "$t" || exit 2
    done
fi
[ "$build_only" = 1 ] && exit 0

triple=$(rustc +nightly -vV | sed -n 's/^host: //p')
bin_dir="$fuzz/target/$triple/release"
per_job=$(((runs + jobs - 1) / jobs))
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_odr_violation=0:detect_leaks=0}

if [ "$seeds" = 1 ]; then
    rm -rf "$fuzz/work/seeds"
    cargo +nightly run --release --manifest-path "$fuzz/Cargo.toml" --example make_seeds -- \
        "$fuzz/work/seeds" || exit 2
    for t in "${targets[@]}"; do
        [ -d "$fuzz/work/seeds/$t" ] || continue
        mkdir -p "$fuzz/corpus/$t"
        "$bin_dir/$t" -merge=1 -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout="$timeout" \
            "$fuzz/corpus/$t" "$fuzz/work/seeds/$t" >"$fuzz/work/seeds/$t.merge.log" 2>&1 ||
            { echo "fuzz.sh: merging the seeds of $t failed, see fuzz/work/seeds/$t.merge.log" >&2; exit 2; }
    done
fi

summary=()
failed=0
for t in "${targets[@]}"; do
    work="$fuzz/work/$t"
    logs="$work/logs"
    rm -rf "$logs"
    mkdir -p "$work/corpus" "$logs" "$fuzz/corpus/$t" "$fuzz/artifacts/$t"
    touch "$logs/.start"
    echo "== $t: $runs executions ($jobs workers × $per_job), logs in ${logs#"$root"/}" >&2
    t0=$(date +%s.%N)
    # libFuzzer's -jobs mode writes each worker's output to fuzz-N.log in the current directory.
    (
        cd "$logs"
        "$bin_dir/$t" "$work/corpus" "$fuzz/corpus/$t" \
            -runs="$per_job" -jobs="$jobs" -workers="$jobs" \
            -timeout="$timeout" -rss_limit_mb=2048 -malloc_limit_mb=512 \
            -max_total_time="$max_time" -print_final_stats=1 \
            -artifact_prefix="$fuzz/artifacts/$t/" >"$logs/main.log" 2>&1
    ) || true
    t1=$(date +%s.%N)
    # Executions: each worker's final stats, or its last status line when it died.
    execs=0
    for log in "$logs"/fuzz-*.log; do
        [ -f "$log" ] || continue
        n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
        if [ -z "$n" ]; then
            n=$(grep -o '^#[0-9]*' "$log" | tr -d '#' | sort -n | tail -1)
        fi
        execs=$((execs + ${n:-0}))
    done
    secs=$(awk "BEGIN { printf \"%.0f\", $t1 - $t0 }")
    rate=$(awk "BEGIN { printf \"%.0f\", $execs / ($t1 - $t0 + 0.001) }")
    found=$(find "$fuzz/artifacts/$t" -type f -newer "$logs/.start" | wc -l)
    if [ "$found" -gt 0 ]; then
        failed=1
        find "$fuzz/artifacts/$t" -type f -newer "$logs/.start" -printf "   artifact: %p\n" >&2
        grep -h -m3 -E 'panicked at|ERROR: (libFuzzer|AddressSanitizer)' "$logs"/fuzz-*.log >&2 || true
    fi
    corpus=$(find "$work/corpus" "$fuzz/corpus/$t" -type f | wc -l)
    summary+=("$(printf '%-18s %14s %10s %10s %8s %10s' "$t" "$execs" "$secs" "$rate" "$found" "$corpus")")
    if [ "$cmin" = 1 ]; then
        # Merge the new inputs into the committed corpus and minimize it.
        cp -n "$work/corpus"/* "$fuzz/corpus/$t"/ 2>/dev/null || true
        cargo +nightly fuzz cmin --fuzz-dir "$fuzz" "$t" "$fuzz/corpus/$t" \
            -- -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout="$timeout" >"$logs/cmin.log" 2>&1 ||
            echo "   cmin failed, see ${logs#"$root"/}/cmin.log" >&2
    fi
done

echo
printf '%-18s %14s %10s %10s %8s %10s\n' target executions seconds exec/s crashes corpus
for line in "${summary[@]}"; do
    echo "$line"
done
exit "$failed"
