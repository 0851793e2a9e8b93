#!/bin/bash
# 12-07 call 2 (256 s of device time left): ab_decode_fusion on 26B-A4B c1 (2 repeats; SIGINT at the limit keeps
# what was measured), the GPU tests of decode_fusion's kernels and the 26B-A4B engine, the L2 probe if time is left
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 95 python3 -m perfkit run configs/ab_decode_fusion.yaml --set "$M" --set "$S" --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|JIT|rror" $OUT/2-ab.log | head -12
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/2-ab_decode_fusion.json; done
rm -rf $OUT/ab
timeout 45 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py -k "glu or pair or 26b" > $OUT/2-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/2-gpu_tests.log
left=$((150 - (SECONDS - t0)))
[ $left -gt 10 ] && { timeout $left python3 docs/h200-runs/2026-12-07/l2_probe.py > $OUT/2-l2_probe.jsonl 2> $OUT/2-l2_probe.err; echo probe rc=$? $((SECONDS-t0))s; tail -1 $OUT/2-l2_probe.err; }
ls -la $OUT
