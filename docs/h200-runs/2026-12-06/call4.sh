#!/bin/bash
# 12-06 call 4: GPU tests of the new defaults (PDL, prefetching gather tiles), ab_pdl on them, the c16 JIT check
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pdl.py > $OUT/4-pdl_tests.log 2>&1; echo pdl tests rc=$? $((SECONDS-t0))s; tail -1 $OUT/4-pdl_tests.log
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k "moe or gather" > $OUT/4-moe_tests.log 2>&1; echo moe tests rc=$? $((SECONDS-t0))s; tail -1 $OUT/4-moe_tests.log
timeout -s INT 250 python3 -m perfkit run configs/ab_pdl.yaml --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|JIT" $OUT/4-ab.log | head -30
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_pdl.json; done
rm -rf $OUT/ab
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c16, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}]'
timeout -s INT 90 python3 -m perfkit run configs/ab_pdl.yaml --set "$M" --set "$S" --set runtime.max_batch_size=16 --set repeats=1 --out $OUT/jit > $OUT/4-jit.log 2>&1; echo jit rc=$? $((SECONDS-t0))s; grep -c "JIT compile" $OUT/4-jit.log; grep -E "TPOT" $OUT/4-jit.log
rm -rf $OUT/jit
ls -la $OUT
