#!/bin/bash
# Two trees on one GPU machine (the layered house, issue 48, against cf00f67 first). ab_refs/trees.tar.xz holds
# both trees without their tests/ and profiles/results/ (to fit the 64 MiB carry): base/ (`git archive REF`) and
# new/ (the tree under test). BASE_BENCH: the base's trace bench module (serving.bench before 026688e). Run with RUN="C1 HOST BIG C16 KER" (any of them;
# GDN: only the GDN prefill row of KER) and ALT (default "base new new base": the order of
# the sides; two calls with ALT="base new" then ALT="new base" on one warm machine make one alternation), carrying
# .gpu (../shared/gpu/make-bundle.sh) and ab_refs. T: GPU tests of this checkout (TESTARGS: paths, default tests/).
[ -d /tmp/site/flash_attn ] || tar -xJf .gpu/site.tar.xz -C /tmp
[ -d /tmp/ab/new ] || { mkdir -p /tmp/ab && tar -xJf ab_refs/trees.tar.xz -C /tmp/ab; }
export PYTHONUNBUFFERED=1 SITE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
HERE=$PWD; NEW=/tmp/ab/new; BASE=/tmp/ab/base
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
side_dir() { [ $1 = base ] && echo $BASE || echo $NEW; }
bench() { [ $1 = base ] && echo ${BASE_BENCH:-serving.bench} || echo profiles.bench_serving; }
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
replay() {  # replay SIDE MODEL TRACE USERS TIMEOUT GREP
  run_side $1 "$2 $3 c$4" $5 python3 -m $(bench $1) --model $2 --trace $3 --concurrency $4 --no-progress \
    --out-dir $(next_dir $1) | grep -E "$6"
}
part() { [[ " $RUN " == *" $1 "* ]]; }
for side in ${ALT:-base new new base}; do
  if part C1; then
    replay $side qwen3.5-2b short 1 120 "^ +all |triton compiles|WARNING"
    replay $side qwen3.5-0.8b short 1 100 "^ +all |triton compiles|WARNING"
  fi
  if part HOST; then
    run_side $side "returning 514" 90 python3 -m profiles.host_time --model qwen3.5-2b --ctx 8192 --new 514 \
      | grep -E "unprofiled|under cProfile"
  fi
  if part BIG; then
    replay $side qwen3.5-9b short 1 150 "^ +all |triton compiles|WARNING"
    replay $side qwen3.5-2b long 1 150 "^ +all |^ +user|triton compiles|WARNING"
  fi
  if part C16; then
    replay $side qwen3.5-2b short 16 150 "^ +all |^ +(kind|mixed|decode ahead) |captured in|triton compiles|WARNING"
  fi
  if part KER; then
    run_side $side "decode attention" 120 python3 -m profiles.bench_decode --only attention --quick --out $OUT/$side \
      | tail -4
  fi
  if part KER || part GDN; then
    run_side $side "gdn prefill" 120 python3 -m profiles.bench_prefill --only gdn --out $OUT/$side | tail -6
  fi
  if part KER; then
    run_side $side "cute prefill" 150 python3 -m profiles.bench_prefill --only cute --out $OUT/$side | tail -8
  fi
done 2>&1 | tee -a $OUT/ab.log
