#!/bin/bash
# 12-10 call 4: call 2's form without every program making the new row (only the program holding it, written after
# its reads): the probe, 26B-A4B c1 separate / fused, then the GPU tests.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 60 python3 docs/h200-runs/2026-12-10/prologue_probe.py > $OUT/4-probe.jsonl 2> $OUT/4-probe.err; echo probe rc=$? $((SECONDS-t0))s
cat $OUT/4-probe.jsonl | python3 -c "
import json, sys
rows = [json.loads(l) for l in sys.stdin]
keys = sorted({(r['shape'], r['batch']) for r in rows}, key=str)
for k in keys:
    print(k, {r['arm']: r['us_per_link'] for r in rows if (r['shape'], r['batch']) == k})"
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 110 python3 -m perfkit run configs/ab_decode_prologue.yaml --set "$M" --set "$S" --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_decode_prologue.json; done; rm -rf $OUT/ab
grep "│ " $OUT/4-ab.log | grep -v scenario | cut -c1-110
timeout 100 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_paged_decode.py -k "prologue" > $OUT/4-pro.log 2>&1; echo "pro rc=$?" >> $OUT/4-pro.log
tail -n 3 $OUT/4-pro.log; echo done $((SECONDS-t0))s
