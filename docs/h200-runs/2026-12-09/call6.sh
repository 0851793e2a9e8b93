#!/bin/bash
# 12-09 call 6: an upper bound on the q/k norm fold: 26B-A4B c1 with the q/k norm + RoPE + KV-write launch left
# out of every one-token step (skip_qknr.py skip: wrong tokens, real timing) between two normal runs.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
for arm in normal skip normal2; do
  a=${arm%2}
  timeout -s INT 120 python3 docs/h200-runs/2026-12-09/skip_qknr.py $a run configs/ab_decode_fusion.yaml --set "$M" --set "$S" --set repeats=2 --set "arms=[]" --out $OUT/r_$arm > $OUT/6-$arm.log 2>&1; echo $arm rc=$? $((SECONDS-t0))s
  for f in $(find $OUT/r_$arm -name result.json); do cp $f $OUT/6-$arm.json; done; rm -rf $OUT/r_$arm
  grep "│ c1" $OUT/6-$arm.log | tail -n 2
done
