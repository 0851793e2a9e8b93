#!/bin/bash
# 12-06 call 1: PDL probe, MoE gather prefetch sweep + its GPU test, c16/c32 JIT check, save the JIT cache
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
t0=$SECONDS
timeout 120 python3 docs/h200-runs/2026-12-05/pdl_probe.py > $OUT/1-pdl.jsonl 2> $OUT/1-pdl.err; echo pdl rc=$? $((SECONDS-t0))s; cat $OUT/1-pdl.jsonl; tail -3 $OUT/1-pdl.err
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k "moe_26b" > $OUT/1-moe_tests.log 2>&1; tail -1 $OUT/1-moe_tests.log; echo $((SECONDS-t0))s
timeout 150 python3 -m perfkit.kernels.moe --tiles --candidates > $OUT/1-gather_prefetch.jsonl 2> $OUT/1-gather_prefetch.err; echo tiles rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-gather_prefetch.err
python3 -c "
import json, os
rows = [json.loads(l) for l in open(os.environ['OUT'] + '/1-gather_prefetch.jsonl')]
for k in ('gate_up', 'down'):
    for T in (1, 8):
        rs = [r for r in rows if r.get('kernel') == k and r.get('T') == T and 'graph_us' in r]
        if not rs: print(k, T, 'no rows'); continue
        best = min(rs, key=lambda r: r['graph_us'])
        print(k, T, 'default', rs[0]['graph_us'], rs[0].get('tiles'), 'best', best['graph_us'], best['tiles'], 'errors', sum('error' in r for r in rows if r.get('kernel') == k and r.get('T') == T))
"
S='scenarios=[{name: c16, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}, {name: c32, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 1}]'
timeout -s INT 200 python3 -m perfkit run configs/ab_decode_attention.yaml --set "$S" --set runtime.max_batch_size=32 --set repeats=1 --out $OUT/ab > $OUT/1-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -c "JIT compile" $OUT/1-ab.log
grep -i "jit" $OUT/1-ab.log | head -5
find $OUT/ab -name result.json | head; for f in $(find $OUT/ab -name result.json); do cp $f $OUT/1-ab_$(basename $(dirname $f)).json; done
rm -rf $OUT/ab
save_jit_cache $OUT
ls -la $OUT
