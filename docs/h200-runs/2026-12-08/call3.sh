#!/bin/bash
# 12-08 call 3: decode_gemv=auto's candidates timed as a chain and after a short PDL kernel (31B / 26B-A4B shapes)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 docs/h200-runs/2026-12-08/context_probe.py > $OUT/3-context_probe.jsonl 2> $OUT/3-context_probe.err; echo probe rc=$? $((SECONDS-t0))s
tail -2 $OUT/3-context_probe.err
python3 -c "
import json
for l in open('$OUT/3-context_probe.jsonl'):
    r = json.loads(l); print(r['shape'], r['cand'], r['chain_us'], r.get('context_us'))"
