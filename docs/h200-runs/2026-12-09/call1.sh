#!/bin/bash
# 12-09 call 1: GPU tests of the routed path, then ab_decode_fusion (separate / fused / routed) at 26B-A4B c1.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
( timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py > $OUT/1-df.log 2>&1; echo "df rc=$?" >> $OUT/1-df.log ) &
( timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k moe > $OUT/1-kf.log 2>&1; echo "kf rc=$?" >> $OUT/1-kf.log ) &
( timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv.py > $OUT/1-gemv.log 2>&1; echo "gemv rc=$?" >> $OUT/1-gemv.log ) &
wait; tail -2 $OUT/1-df.log $OUT/1-kf.log $OUT/1-gemv.log; echo tests $((SECONDS-t0))s
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 200 python3 -m perfkit run configs/ab_decode_fusion.yaml --set "$M" --set "$S" --set repeats=3 --out $OUT/ab > $OUT/1-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/1-ab_decode_fusion.json; done; rm -rf $OUT/ab
tail -5 $OUT/1-ab.log
