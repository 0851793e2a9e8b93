#!/bin/bash
# 12-06 call 2: PDL GPU tests, the MoE gather fix's GPU test, engine A/B pdl off / on (c1 / c4 / c8, both models)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)-dirty
t0=$SECONDS
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pdl.py > $OUT/2-pdl_tests.log 2>&1; echo pdl tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/2-pdl_tests.log
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k "moe_26b" > $OUT/2-moe_tests.log 2>&1; echo moe tests rc=$? $((SECONDS-t0))s; tail -1 $OUT/2-moe_tests.log
timeout -s INT 330 python3 -m perfkit run configs/ab_pdl.yaml --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|JIT|error|Error" $OUT/2-ab.log | head -30
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/2-ab_pdl.json; done
rm -rf $OUT/ab
ls -la $OUT
