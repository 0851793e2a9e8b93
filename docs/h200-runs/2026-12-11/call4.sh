#!/bin/bash
# 12-11 call 4: the probe again with the dense down as column slots, ab_decode_moe_ffn at c1, then
# decode_moe_ffn's GPU tests.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 70 python3 docs/h200-runs/2026-12-11/ffn_probe.py > $OUT/4-ffn_probe.jsonl 2> $OUT/4-ffn_probe.err; echo "probe rc=$? $((SECONDS-t0))s"
cat $OUT/4-ffn_probe.jsonl; tail -3 $OUT/4-ffn_probe.err
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 120 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$S" --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_decode_moe_ffn.json; done; rm -rf $OUT/ab
grep "│ " $OUT/4-ab.log | grep -v scenario | cut -c1-130
timeout 75 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_ffn.py > $OUT/4-ffn.log 2>&1; echo "ffn rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/4-ffn.log
echo done $((SECONDS-t0))s
