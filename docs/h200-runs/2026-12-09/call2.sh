#!/bin/bash
# 12-09 call 2: GPU tests (gemv_routed, the MoE kernels without EARLY, PDL, the decode kernel's reads before its
# PDL wait), then ab_decode_fusion (separate / fused / routed) at 26B-A4B c1, 3 repeats, three times in a row:
# new code, the same with the decode kernel of d0b4f28 (.carry/old: reads after the wait), new code again.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
( timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py > $OUT/2-df.log 2>&1; echo "df rc=$?" >> $OUT/2-df.log ) &
( timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k moe tests/test_gemv.py > $OUT/2-kf.log 2>&1; echo "kf rc=$?" >> $OUT/2-kf.log ) &
( timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pdl.py > $OUT/2-pdl.log 2>&1; echo "pdl rc=$?" >> $OUT/2-pdl.log ) &
( timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_decode.py > $OUT/2-pd.log 2>&1; echo "pd rc=$?" >> $OUT/2-pd.log ) &
wait; for f in $OUT/2-df.log $OUT/2-kf.log $OUT/2-pdl.log $OUT/2-pd.log; do tail -n 2 $f; done; echo tests $((SECONDS-t0))s
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
for arm in new old new2; do
  pp=$PYTHONPATH; [ $arm = old ] && pp=$(pwd)/.carry/old:$PYTHONPATH
  PYTHONPATH=$pp timeout -s INT 150 python3 -m perfkit run configs/ab_decode_fusion.yaml --set "$M" --set "$S" --set repeats=3 --out $OUT/ab_$arm > $OUT/2-ab_$arm.log 2>&1; echo ab $arm rc=$? $((SECONDS-t0))s
  for f in $(find $OUT/ab_$arm -name result.json); do cp $f $OUT/2-ab_$arm.json; done; rm -rf $OUT/ab_$arm
  grep "c1 " $OUT/2-ab_$arm.log | tail -n 3
done
