#!/bin/bash
# 12-08 call 2: decode_fusion's GLU form only where decode_gemv=auto timed it faster (31B lost 1.7 % in call 1):
# its timing rows, the GPU tests of it, the A/B at c1 on both models; then 8-row W4A16 wide tiles (#10).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
D=docs/h200-runs/2026-12-08
timeout 60 python3 $D/glu_timing.py > $OUT/2-glu_timing.jsonl 2> $OUT/2-glu_timing.err; echo glu rc=$? $((SECONDS-t0))s
python3 -c "
import json
for l in open('$OUT/2-glu_timing.jsonl'):
    r = json.loads(l); print(r['shape'], 'plain', r['best'], r['best_us'], 'glu', r['glu'])"
( timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv.py -k auto > $OUT/2-gpu_tests.log 2>&1; echo "gemv auto rc=$?" >> $OUT/2-gpu_tests.log ) &
( timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py > /tmp/df.log 2>&1; echo "decode_fusion rc=$?" >> /tmp/df.log ) &
wait; cat /tmp/df.log >> $OUT/2-gpu_tests.log; grep -E "passed|failed|rc=" $OUT/2-gpu_tests.log; echo tests $((SECONDS-t0))s
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 150 python3 -m perfkit run configs/ab_decode_fusion.yaml --set "$S" --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
grep -E "TPOT|JIT|rror" $OUT/2-ab.log | head -12
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/2-ab_decode_fusion.json; done; rm -rf $OUT/ab
timeout 120 python3 $D/w4a16_bn8.py > $OUT/2-w4a16_bn8.jsonl 2> $OUT/2-w4a16_bn8.err; echo w4 rc=$? $((SECONDS-t0))s
python3 -c "
import json
for l in open('$OUT/2-w4a16_bn8.jsonl'):
    r = json.loads(l)
    if 'us' in r or 'ms' in r: print({k: r[k] for k in r if k in ('N','K','config','us','ms','pct_stream','stream_us','rel_err_vs_ref')})"
