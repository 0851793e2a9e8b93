#!/bin/bash
# 12-11 call 5: where the fused FFN block's step goes in the engine (pdl off: each kernel's own time), both arms,
# torch profile, one repeat.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 2, warmup_requests: 1}]'
timeout -s INT 105 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$S" --set repeats=1 --set toggles.pdl=off --profile torch --out $OUT/p > $OUT/5-profile.log 2>&1; echo profile rc=$? $((SECONDS-t0))s
for f in $(find $OUT/p -name result.json); do cp $f $OUT/5-profile_26b_c1.json; done; rm -rf $OUT/p
grep "│ " $OUT/5-profile.log | grep -v scenario | cut -c1-110
