#!/bin/bash
# 12-10 call 1: GPU tests of the q/k norm + RoPE prologue in the Triton decode kernel (kernel vs the separate
# launch at real shapes, graph replay with new slots, engine tokens with decode_prologue fused vs separate), then
# ab_decode_prologue (31B and 26B-A4B, c1 / c4 / c16, separate / fused, 2 repeats).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 230 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_paged_decode.py -k "prologue" > $OUT/1-pro.log 2>&1; echo "pro rc=$?" >> $OUT/1-pro.log
tail -n 3 $OUT/1-pro.log; grep "max |out" $OUT/1-pro.log | head -40; echo tests $((SECONDS-t0))s
timeout -s INT 300 python3 -m perfkit run configs/ab_decode_prologue.yaml --out $OUT/ab > $OUT/1-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/1-ab_decode_prologue.json; done; rm -rf $OUT/ab
grep "│ c" $OUT/1-ab.log | tail -n 12
save_jit_cache $OUT; echo done $((SECONDS-t0))s
