#!/bin/bash
# 12-08 call 4: the routing inside the router + gate_up launch (gemv_pair_routed) and the early gather gate_up:
# GPU tests, then ab_decode_fusion at 26B-A4B c1, 3 repeats (separate = the anchor: in call 2 fused was -3.5 %
# without these two)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
( timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py > /tmp/a.log 2>&1; echo "decode_fusion rc=$?" >> /tmp/a.log ) &
( timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv.py tests/test_pdl.py > /tmp/b.log 2>&1; echo "gemv+pdl rc=$?" >> /tmp/b.log ) &
( timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py > /tmp/c.log 2>&1; echo "kernels_fused rc=$?" >> /tmp/c.log ) &
wait; cat /tmp/a.log /tmp/b.log /tmp/c.log > $OUT/4-gpu_tests.log; grep -E "passed|failed|rc=|Error" $OUT/4-gpu_tests.log | head -20; echo tests $((SECONDS-t0))s
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 130 python3 -m perfkit run configs/ab_decode_fusion.yaml --set "$M" --set "$S" --set repeats=3 --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|JIT|rror" $OUT/4-ab.log | head -12
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_decode_fusion.json; done; rm -rf $OUT/ab
# decode_gemv=auto's timing after an rmsnorm (context, new default) vs the plain chain: one run per arm, both models
# (31B only, the model where the choices differ most) at c1, 2 repeats, context first then chain (arm.py sets gemv.TIMING_AFTER_NORM)
A='arms=[{name: fused, toggles: {decode_fusion: on}}]'
M31='models=[{preset: 31b, weights: random, dtype: bfloat16, device: cuda}]'
for arm in context chain; do
  timeout -s INT 85 python3 docs/h200-runs/2026-12-08/arm.py $arm run configs/ab_decode_fusion.yaml --set "$M31" --set "$S" --set "$A" --out $OUT/$arm > $OUT/4-$arm.log 2>&1; echo $arm rc=$? $((SECONDS-t0))s
  grep -E "TPOT" $OUT/4-$arm.log | head -4
  for f in $(find $OUT/$arm -name result.json); do cp $f $OUT/4-auto_$arm.json; done; rm -rf $OUT/$arm
done
