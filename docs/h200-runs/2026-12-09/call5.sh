#!/bin/bash
# 12-09 call 5: where a 26B-A4B batch-1 step goes now (defaults: decode_routing fused), pdl off, torch profile.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 150 python3 -m perfkit run configs/ab_pdl.yaml --set "$M" --set "$S" --set repeats=1 --set "arms=[]" --set toggles.pdl=off --profile torch --out $OUT/p > $OUT/5-profile.log 2>&1; echo profile rc=$? $((SECONDS-t0))s
for f in $(find $OUT/p -name result.json); do cp $f $OUT/5-profile_26b_c1.json; done; rm -rf $OUT/p
grep -E "TPOT|rror" $OUT/5-profile.log | head -5
