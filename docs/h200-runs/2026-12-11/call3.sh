#!/bin/bash
# 12-11 call 3: where decode_moe_ffn loses (ffn_probe.py: the FFN chain's pieces in CUDA graphs).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 150 python3 docs/h200-runs/2026-12-11/ffn_probe.py > $OUT/3-ffn_probe.jsonl 2> $OUT/3-ffn_probe.err; echo "probe rc=$? $((SECONDS-t0))s"
cat $OUT/3-ffn_probe.jsonl; tail -3 $OUT/3-ffn_probe.err
echo done $((SECONDS-t0))s
