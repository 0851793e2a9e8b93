#!/bin/bash
# 12-09 call 3: GPU tests of the routing in the plain / GLU down gemv's launch, then the full ab_decode_fusion
# (31B and 26B-A4B, c1 / c4, separate / fused / routed), 2 repeats.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py > $OUT/3-df.log 2>&1; echo "df rc=$?" >> $OUT/3-df.log
tail -n 2 $OUT/3-df.log; echo tests $((SECONDS-t0))s
timeout -s INT 330 python3 -m perfkit run configs/ab_decode_fusion.yaml --out $OUT/ab > $OUT/3-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/3-ab_decode_fusion.json; done; rm -rf $OUT/ab
grep "│ c" $OUT/3-ab.log | tail -n 12
