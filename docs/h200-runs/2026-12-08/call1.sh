#!/bin/bash
# 12-08 call 1: the owed GPU test files (8 processes in parallel, one per file, 150 s each), the full
# ab_decode_fusion (31B half never run; c4 the control), then the norm-in-gemv probe prepared on 12-07.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,memory.used --format=csv > $OUT/1-smi.txt
for f in test_decode_fusion test_engine_fused test_gemv test_kv_fp8 test_fp8_gemv test_stream test_jit_log test_gemma_mask; do
  ( timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/$f.py > /tmp/t-$f.log 2>&1; echo "$f rc=$? $((SECONDS-t0))s: $(tail -1 /tmp/t-$f.log)" >> /tmp/t-summary.txt ) &
done
wait
cat /tmp/t-summary.txt
for f in test_decode_fusion test_engine_fused test_gemv test_kv_fp8 test_fp8_gemv test_stream test_jit_log test_gemma_mask; do echo "=== $f"; grep -E "passed|failed|FAIL|Error|error" /tmp/t-$f.log | tail -15; done > $OUT/1-gpu_tests.log
cat /tmp/t-summary.txt >> $OUT/1-gpu_tests.log
timeout -s INT 220 python3 -m perfkit run configs/ab_decode_fusion.yaml --out $OUT/ab > $OUT/1-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|JIT|rror" $OUT/1-ab.log | head -12
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/1-ab_decode_fusion.json; done; rm -rf $OUT/ab
timeout 60 python3 docs/h200-runs/2026-12-07/norm_probe.py > $OUT/1-norm_probe.jsonl 2> $OUT/1-norm_probe.err; echo probe rc=$? $((SECONDS-t0))s
tail -2 $OUT/1-norm_probe.err; cat $OUT/1-norm_probe.jsonl | cut -c1-200
