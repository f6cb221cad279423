#!/bin/bash
# MTP speculative decoding on one GPU machine (carry .gpu: ../shared/gpu/make-bundle.sh). RUN="T STEPS E2E" (any):
# T the GPU tests of the verify kernel, the speculative engine and the TMA GEMV; STEPS profiles.bench_spec for
# MODELS (default 0.8B, 2B and 9B: the verify step's variants and a 32k draft vocab beside the full one); E2E the
# short agent trace
# at batch 1, plain and with K = 3 drafts from a 32k draft vocab forced to mean acceptance lengths L (LS, default
# "3 4"), each over SWEEP (default decode_ahead=0,1: greedy steps launched ahead or not) in one process (MODEL,
# default qwen3.5-2b). Prints the host's CPU model.
[ -d /tmp/site/flash_attn ] || tar -xJf .gpu/site.tar.xz -C /tmp
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
if [[ " $RUN " == *" T "* ]]; then
  timeout ${TT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gdn_verify.py \
    tests/test_speculative_engine.py tests/test_tma_gemv.py 2>&1 | tail -15 | tee $OUT/spec_tests.log
fi
if [[ " $RUN " == *" STEPS "* ]]; then
  for m in ${MODELS:-qwen3.5-0.8b qwen3.5-2b qwen3.5-9b}; do
    timeout 200 python3 -m profiles.bench_spec --model $m --ctx 8192 --draft-vocab 32768 --out $OUT/$m 2>&1 \
      | grep -v "^{" | tee -a $OUT/steps.log
  done
fi
if [[ " $RUN " == *" E2E "* ]]; then
  M=${MODEL:-qwen3.5-2b}
  timeout 150 python3 -m profiles.bench_serving --model $M --trace short --no-progress --out-dir $OUT/e2e 2>&1 \
    | grep -E "^ +all |speculative" | tee -a $OUT/e2e.log
  for L in ${LS:-3 4}; do
    timeout 300 python3 -m profiles.bench_serving --model $M --trace short --no-progress --out-dir $OUT/e2e \
      --speculative-tokens 3 --forced-acceptance $L --speculative-draft-vocab 32768 \
      --sweep ${SWEEP:-decode_ahead=0,1} 2>&1 | grep -E "^ +all |speculative|engine:|^=== " \
      | tee -a $OUT/e2e.log
  done
fi
