#!/bin/bash
# 12-12 call 1: burst tiles (a program's whole row block in one step) for the 26B-A4B batch-1 gather kernels and
# gemvs, and the load-only stream ceiling at the step's read sizes (one launch and a back-to-back chain).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
P=docs/h200-runs/2026-12-12/burst_probe.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout 100 python3 $P gather > $OUT/1-gather.jsonl 2> $OUT/1-gather.err; echo "gather rc=$? $((SECONDS-t0))s"
timeout 250 python3 $P gemv > $OUT/1-gemv.jsonl 2> $OUT/1-gemv.err; echo "gemv rc=$? $((SECONDS-t0))s"
timeout 120 python3 $P stream > $OUT/1-stream.jsonl 2> $OUT/1-stream.err; echo "stream rc=$? $((SECONDS-t0))s"
tail -n 3 $OUT/*.err
echo done $((SECONDS-t0))s
