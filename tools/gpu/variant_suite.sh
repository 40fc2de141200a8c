#!/usr/bin/env bash
# The GPU kernel tests and whole steps again under each variant's switches (ENV=VALUE words;
# several variables as one argument, "A=0 B=1"): the kernels' compile choices and the one-row
# launches. Runs the test binaries decode_ab.sh and against_llama.sh unpack into /var/tmp/b.
# Usage there: bash tools/gpu/variant_suite.sh [ENV=VALUE ...]
for e in "$@"; do
  echo "== kernels under $e"
  env $e timeout 150 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
  echo "== whole steps under $e"
  env $e timeout 120 /var/tmp/b/gpu_model --nocapture --test-threads 1 whole_steps 2>&1 |
    grep -E "test result|panicked|FAILED|one row a step"
done
