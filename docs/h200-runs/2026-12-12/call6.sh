#!/bin/bash
# 12-12 call 6: the routing launch on the experts' branch by warps and top-k form.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 150 python3 docs/h200-runs/2026-12-12/routing_probe.py > $OUT/6-routing.jsonl 2> $OUT/6-routing.err; echo "probe rc=$? $((SECONDS-t0))s"
tail -n 4 $OUT/6-routing.err; cat $OUT/6-routing.jsonl
echo done $((SECONDS-t0))s
