#!/bin/bash
# The layered house (issue 48) against cf00f67 on one GPU machine: `git archive cf00f67 | tar -x -C ab_refs/base` here
# first (drop its tests/ and profiles/results/ to fit the 64 MiB carry), then run with RUN=T|AB1|AB2|AB3|AB4, carrying
# .gpu (../shared/gpu/make-bundle.sh) and ab_refs. T: GPU tests (TESTARGS: paths, default tests/); AB*: base, new, alternated.
[ -d /tmp/site/flash_attn ] || tar -xJf .gpu/site.tar.xz -C /tmp
export PYTHONUNBUFFERED=1 SITE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
NEW=$PWD; BASE=$PWD/ab_refs/base
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
side_dir() { [ $1 = base ] && echo $BASE || echo $NEW; }
bench() { [ $1 = base ] && echo serving.bench || echo profiles.bench_serving; }
if [ "$RUN" = T ]; then
  cd $NEW; export PYTHONPATH=$NEW:$SITE
  timeout ${TT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTARGS:-tests/} 2>&1 | tail -30 | tee $OUT/gpu_tests.log
fi
if [ "$RUN" = AB1 ]; then
  for rep in 1 2; do for side in base new; do
    d=$(side_dir $side); cd $d; export PYTHONPATH=$d:$SITE; mkdir -p $OUT/$side
    for c in 1 16; do
      echo "=== $side rep $rep 2B c$c"
      timeout 150 python3 -m $(bench $side) --model qwen3.5-2b --trace short --concurrency $c --no-progress --out-dir $OUT/$side 2>&1 | grep -E "^overall|decode_tok_s|mixed" | head -4
    done
  done; done 2>&1 | tee $OUT/ab1.log
fi
if [ "$RUN" = AB2 ]; then
  for rep in 1 2; do for side in base new; do
    d=$(side_dir $side); cd $d; export PYTHONPATH=$d:$SITE; mkdir -p $OUT/$side
    echo "=== $side rep $rep 0.8B c1"; timeout 100 python3 -m $(bench $side) --model qwen3.5-0.8b --trace short --concurrency 1 --no-progress --out-dir $OUT/$side 2>&1 | tail -3
    echo "=== $side rep $rep returning 514"; timeout 150 python3 -m profiles.host_time --model qwen3.5-2b --ctx 8192 --new 514 2>&1 | grep -E "unprofiled|under cProfile"
  done; done 2>&1 | tee $OUT/ab2.log
fi
if [ "$RUN" = AB3 ]; then
  for side in base new new base; do
    d=$(side_dir $side); cd $d; export PYTHONPATH=$d:$SITE; mkdir -p $OUT/$side
    echo "=== $side 9B c1"; timeout 150 python3 -m $(bench $side) --model qwen3.5-9b --trace short --concurrency 1 --no-progress --out-dir $OUT/$side 2>&1 | tail -3
    echo "=== $side 2B long"; timeout 150 python3 -m $(bench $side) --model qwen3.5-2b --trace long --concurrency 1 --no-progress --out-dir $OUT/$side 2>&1 | tail -3
  done 2>&1 | tee $OUT/ab3.log
fi
if [ "$RUN" = AB4 ]; then
  for side in base new new base; do
    d=$(side_dir $side); cd $d; export PYTHONPATH=$d:$SITE; mkdir -p $OUT/$side
    echo "=== $side kernels"; timeout 200 python3 -m profiles.bench_decode --only attention --quick --out $OUT/$side 2>&1 | tail -4
    timeout 200 python3 -m profiles.bench_prefill --only gdn --out $OUT/$side 2>&1 | tail -6
  done 2>&1 | tee $OUT/ab4.log
fi
