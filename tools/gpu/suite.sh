#!/usr/bin/env bash
# The GPU suite of a tree on the device host: PACK/bins.tar.xz holds gpu_kernels and gpu_model
# (stripped from `cargo test --release -p gpu --no-run`), PACK/fixtures.tar.xz the fixture
# folders to test (qwen3moe and llama, say: tar of crates/model/tests/fixtures/{qwen3moe,llama}).
# Run there: bash tools/gpu/suite.sh PACK > $OUT/suite.txt 2>&1
set -x
source "$(dirname "$0")/unpack_pack.sh" "$1"
nvidia-smi --query-gpu=name,memory.total --format=csv; date +%T
timeout 200 /var/tmp/b/gpu_kernels --test-threads 1 2>&1 | grep -v '^$' | tail -15
date +%T
timeout 380 /var/tmp/b/gpu_model --nocapture --test-threads 1 2>&1 | grep -v '^$' | tail -80
date +%T; echo done
