#!/bin/bash
# 12-12 call 6: with moe_routing on one warp (this commit), ab_decode_moe_ffn separate vs branches at c1 / c4; the
# routing kernel's tests on CUDA; the routing launch by warps and top-k form (probe).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches, toggles: {decode_moe_ffn: branches}}]'
timeout -s INT 150 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$A" --out $OUT/ab > $OUT/6-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/6-ab_decode_moe_ffn.json; done; rm -rf $OUT/ab
grep "│ " $OUT/6-ab.log | grep -v scenario | cut -c1-120
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py -k "routing" > $OUT/6-kf.log 2>&1; echo "kf rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/6-kf.log
timeout 80 python3 docs/h200-runs/2026-12-12/routing_probe.py > $OUT/6-routing.jsonl 2> $OUT/6-routing.err; echo "probe rc=$? $((SECONDS-t0))s"
tail -n 4 $OUT/6-routing.err; grep arm $OUT/6-routing.jsonl; grep check $OUT/6-routing.jsonl | head -3
echo done $((SECONDS-t0))s
