#!/bin/bash
# 12-12 call 3: the FFN block's two branches (dense MLP, routed experts) as two CUDA-graph branches.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 docs/h200-runs/2026-12-12/branch_probe.py > $OUT/3-branch.jsonl 2> $OUT/3-branch.err; echo "branch rc=$? $((SECONDS-t0))s"
tail -n 5 $OUT/3-branch.err; cat $OUT/3-branch.jsonl
echo done $((SECONDS-t0))s
