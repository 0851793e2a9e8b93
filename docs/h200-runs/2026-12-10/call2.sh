#!/bin/bash
# 12-10 call 2 (commit 2b07abe): the probe (without the _old arms, added for call 3), then ab_decode_prologue c1 / c4,
# then the GPU tests. The prologue here: every program makes the new row before its loop; the last block peeled.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 120 python3 docs/h200-runs/2026-12-10/prologue_probe.py > $OUT/2-probe.jsonl 2> $OUT/2-probe.err; echo probe rc=$? $((SECONDS-t0))s
cat $OUT/2-probe.jsonl | python3 -c "
import json, sys
rows = [json.loads(l) for l in sys.stdin]
keys = sorted({(r['shape'], r['batch']) for r in rows}, key=str)
for k in keys:
    print(k, {r['arm']: r['us_per_link'] for r in rows if (r['shape'], r['batch']) == k})"
tail -n 3 $OUT/2-probe.err
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}]'
timeout -s INT 200 python3 -m perfkit run configs/ab_decode_prologue.yaml --set "$S" --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/2-ab_decode_prologue.json; done; rm -rf $OUT/ab
grep "│ " $OUT/2-ab.log | grep -v scenario | cut -c1-110
timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_paged_decode.py -k "prologue" > $OUT/2-pro.log 2>&1; echo "pro rc=$?" >> $OUT/2-pro.log
tail -n 3 $OUT/2-pro.log; echo done $((SECONDS-t0))s
