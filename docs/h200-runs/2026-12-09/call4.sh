#!/bin/bash
# 12-09 call 4: the L2 ride-along prefetch probe (docs/h200-runs/2026-12-09/l2_ride_probe.py).
source .carry/bootstrap.sh
t0=$SECONDS
timeout 200 python3 docs/h200-runs/2026-12-09/l2_ride_probe.py > $OUT/4-l2_ride.jsonl 2> $OUT/4-l2_ride.err; echo probe rc=$? $((SECONDS-t0))s
cat $OUT/4-l2_ride.jsonl; tail -n 5 $OUT/4-l2_ride.err
