#!/bin/bash
# The layered house (issue 48) against cf00f67 on one GPU machine. ab_refs/trees.tar.xz holds both trees without
# their tests/ and profiles/results/ (to fit the 64 MiB carry): base/ (`git archive cf00f67`) and new/ (the layered
# house's commit). Run with RUN="T C1 BIG KER" (any of them), carrying .gpu (../shared/gpu/make-bundle.sh) and ab_refs.
# T: GPU tests of this checkout (TESTARGS: paths, default tests/); the others: base, new, new, base.
[ -d /tmp/site/flash_attn ] || tar -xJf .gpu/site.tar.xz -C /tmp
[ -d /tmp/ab/new ] || { mkdir -p /tmp/ab && tar -xJf ab_refs/trees.tar.xz -C /tmp/ab; }
export PYTHONUNBUFFERED=1 SITE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
HERE=$PWD; NEW=/tmp/ab/new; BASE=/tmp/ab/base
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
side_dir() { [ $1 = base ] && echo $BASE || echo $NEW; }
bench() { [ $1 = base ] && echo serving.bench || echo profiles.bench_serving; }
if [[ " $RUN " == *" T "* ]]; then
  cd $HERE; export PYTHONPATH=$HERE:$SITE
  timeout ${TT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTARGS:-tests/} 2>&1 | tail -30 | tee $OUT/gpu_tests.log
fi
run_side() {  # run_side SIDE LABEL TIMEOUT CMD...: one fresh process of SIDE's tree
  local side=$1 label=$2 t=$3; shift 3; local d=$(side_dir $side)
  cd $d; export PYTHONPATH=$d:$SITE; mkdir -p $OUT/$side; echo "=== $side $label"
  timeout $t "$@" 2>&1
}
# each replay's results in a folder of its own ($OUT/side/<ns clock>): serving.json keeps one run a key
next_dir() { echo $OUT/$1/$(date +%s%N); }
ALTERNATION="base new new base"
if [[ " $RUN " == *" C1 "* ]]; then  # the c1 rows and the returning turn's host time
  for side in $ALTERNATION; do
    run_side $side "2B c1" 120 python3 -m $(bench $side) --model qwen3.5-2b --trace short --concurrency 1 \
      --no-progress --out-dir $(next_dir $side) | grep -E "^ +all |triton compiles|WARNING"
    run_side $side "0.8B c1" 100 python3 -m $(bench $side) --model qwen3.5-0.8b --trace short --concurrency 1 \
      --no-progress --out-dir $(next_dir $side) | grep -E "^ +all |triton compiles|WARNING"
    run_side $side "returning 514" 90 python3 -m profiles.host_time --model qwen3.5-2b --ctx 8192 --new 514 \
      | grep -E "unprofiled|under cProfile"
  done 2>&1 | tee $OUT/c1.log
fi
if [[ " $RUN " == *" BIG "* ]]; then  # 9B c1 and the long trace's returning TTFT
  for side in $ALTERNATION; do
    run_side $side "9B c1" 150 python3 -m $(bench $side) --model qwen3.5-9b --trace short --concurrency 1 \
      --no-progress --out-dir $(next_dir $side) | tail -3
    run_side $side "2B long" 150 python3 -m $(bench $side) --model qwen3.5-2b --trace long --concurrency 1 \
      --no-progress --out-dir $(next_dir $side) | tail -3
  done 2>&1 | tee $OUT/big.log
fi
if [[ " $RUN " == *" KER "* ]]; then  # B1 decode attention, GDN prefill, CuTe prefill against flash-attn-4
  for side in $ALTERNATION; do
    run_side $side "decode attention" 120 python3 -m profiles.bench_decode --only attention --quick --out $OUT/$side \
      | tail -4
    run_side $side "gdn prefill" 120 python3 -m profiles.bench_prefill --only gdn --out $OUT/$side | tail -6
    run_side $side "cute prefill" 150 python3 -m profiles.bench_prefill --only cute --out $OUT/$side | tail -8
  done 2>&1 | tee $OUT/ker.log
fi
