#!/bin/bash
# 12-12 call 2: register-lean forms (each step reduced over K at once) of the batch-1 gemv and gather kernels.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 300 python3 docs/h200-runs/2026-12-12/lean_probe.py gather gemv > $OUT/2-lean.jsonl 2> $OUT/2-lean.err; echo "lean rc=$? $((SECONDS-t0))s"
tail -n 3 $OUT/2-lean.err
grep -v check $OUT/2-lean.jsonl | cut -c1-200
echo done $((SECONDS-t0))s
