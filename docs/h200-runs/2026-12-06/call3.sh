#!/bin/bash
# 12-06 call 3: c1 profiles with pdl off / on (both models), the gather prefetch sweep, the MoE GPU tests
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)-dirty
t0=$SECONDS
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 2, warmup_requests: 1}]'
timeout -s INT 200 python3 -m perfkit run configs/ab_pdl.yaml --set "$S" --set repeats=1 --profile torch --out $OUT/ab > $OUT/3-profile.log 2>&1; echo profile rc=$? $((SECONDS-t0))s
grep -E "TPOT" $OUT/3-profile.log | head
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/3-ab_c1_profile.json; done
rm -rf $OUT/ab
timeout 170 python3 docs/h200-runs/2026-12-06/gather_sweep.py > $OUT/3-gather_sweep.jsonl 2> $OUT/3-gather_sweep.err; echo sweep rc=$? $((SECONDS-t0))s; tail -2 $OUT/3-gather_sweep.err
python3 -c "
import json, os
rows = [json.loads(l) for l in open(os.environ['OUT'] + '/3-gather_sweep.jsonl')]
for k in ('gate_up', 'down'):
    for T in (1, 4, 16):
        rs = [r for r in rows if r.get('kernel') == k and r.get('T') == T and 'graph_us' in r]
        if not rs: print(k, T, 'no rows'); continue
        best = sorted(rs, key=lambda r: r['graph_us'])[:3]
        print(k, T, 'default', rs[0]['graph_us'], 'best', [(b['graph_us'], b['tiles']) for b in best], 'errors', sum('error' in r for r in rows if r.get('kernel') == k and r.get('T') == T))
"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fused.py -k "moe_26b or tile_sweep" > $OUT/3-moe_tests.log 2>&1; echo moe tests rc=$? $((SECONDS-t0))s; tail -1 $OUT/3-moe_tests.log
ls -la $OUT
