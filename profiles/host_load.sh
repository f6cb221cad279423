#!/bin/bash
# Issue 49 on one GPU machine (carry .gpu: ../shared/gpu/make-bundle.sh): T the prefill graphs' GPU tests (the whole
# log in $OUT/gpu_tests.log, its errors printed); C16:
# 2B at 16 users with the prefill graphs off (0) and on (every step), alternated in one process, the mixed
# steps' host_busy_ms beside their wall, and the returning 514-token step's host time; SESSIONS: section 1's rows (64
# sessions over 8 users: A with the KV pool for all and 2 snapshot slots a session, B with 75% of the working set);
# HOSTBOUND: 2B at 16 users on this host and on a host-bound one emulated here (its replay pinned to one CPU shared
# with 1 and 2 busy processes, profiles.shared_cpu), alternated in one process, each run's mixed-step row.
# Prints the host's CPU model.
[ -d /tmp/site/flash_attn ] || tar -xJf .gpu/site.tar.xz -C /tmp
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; nproc
if [[ " $RUN " == *" T "* ]]; then
  timeout ${TT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short ${TESTARGS:-tests/test_prefill_graphs.py \
    tests/test_decode_attention.py tests/test_serving_graphs.py tests/test_gdn_prefill.py} > $OUT/gpu_tests.log 2>&1
  grep -v CUDAGraph.cpp $OUT/gpu_tests.log | grep -E "^E |^FAILED|passed|failed" | head -30
fi
if [[ " $RUN " == *" C16 "* ]]; then
  timeout 300 python3 -m profiles.bench_serving --model qwen3.5-2b --trace short --concurrency 16 --no-progress \
    --sweep prefill_graphs=0,8208 --repeat ${REPEAT:-1} --out-dir $OUT/c16 2>&1 | tail -40 | tee $OUT/c16.log
fi
if [[ " $RUN " == *" HOSTBOUND "* ]]; then
  timeout ${HT:-420} python3 -m profiles.bench_serving --model qwen3.5-2b --trace short --concurrency 16 --no-progress \
    --sweep host_hogs=${HOGS:-0,1,2} --repeat ${REPEAT:-2} --out-dir $OUT/hostbound > $OUT/hostbound.log 2>&1
  grep -E "^=== |^ +mixed |^ +decode ahead " $OUT/hostbound.log; tail -12 $OUT/hostbound.log
fi
if [[ " $RUN " == *" HOST "* ]]; then
  timeout 150 python3 -m profiles.host_time --model qwen3.5-2b --ctx 8192 --new 514 2>&1 \
    | grep -E "^host:|unprofiled|under cProfile|GPU busy" | tee $OUT/host_time.log
fi
if [[ " $RUN " == *" SESSIONS "* ]]; then
  for kv in 2 0.75; do
    timeout 280 python3 -m profiles.bench_serving --model qwen3.5-2b --trace short --sessions=64 --concurrency 8 \
      --snapshot-slots 128 --kv-working-set $kv --no-progress --out-dir "$OUT/interleaved" 2>&1 \
      | grep -E "sessions interleaved|^ +all |returning" | tee -a $OUT/sessions.log
  done
fi
