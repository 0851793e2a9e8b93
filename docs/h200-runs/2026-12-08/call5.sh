#!/bin/bash
# 12-08 call 5 (~290 s of device time left): call 4's GPU tests again after the triton-3.6 fix (moe_routing), then
# ab_decode_fusion at 26B-A4B c1, 2 repeats
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
( timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py -k "routed or 26b" > /tmp/a.log 2>&1; echo "decode_fusion rc=$?" >> /tmp/a.log ) &
( timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pdl.py > /tmp/b.log 2>&1; echo "pdl rc=$?" >> /tmp/b.log ) &
( timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k "moe" > /tmp/c.log 2>&1; echo "kernels_fused rc=$?" >> /tmp/c.log ) &
wait; cat /tmp/a.log /tmp/b.log /tmp/c.log > $OUT/5-gpu_tests.log; grep -E "^FAILED|passed|failed|rc=" $OUT/5-gpu_tests.log | head -20; echo tests $((SECONDS-t0))s
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 75 python3 -m perfkit run configs/ab_decode_fusion.yaml --set "$M" --set "$S" --set repeats=2 --out $OUT/ab > $OUT/5-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|rror" $OUT/5-ab.log | head -8
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/5-ab_decode_fusion.json; done; rm -rf $OUT/ab
