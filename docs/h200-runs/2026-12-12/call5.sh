#!/bin/bash
# 12-12 call 5: GPU tests of the branches and of the routed gather kernel; then ab_decode_moe_ffn: separate,
# branches (routing inside the experts' gate_up launch, decode_routing fused) and branches with the routing launch
# (decode_routing separate), 26B-A4B c1 / c4.
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ffn_branches.py > $OUT/5-tests.log 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -n 4 $OUT/5-tests.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py -k "moe or gather or routed" > $OUT/5-kf.log 2>&1; echo "kf rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/5-kf.log
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches, toggles: {decode_moe_ffn: branches}}, {name: branches_rl, toggles: {decode_moe_ffn: branches, decode_routing: separate}}]'
timeout -s INT 200 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$A" --out $OUT/ab > $OUT/5-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/5-ab_decode_moe_ffn.json; done; rm -rf $OUT/ab
grep "│ " $OUT/5-ab.log | grep -v scenario | cut -c1-150
echo done $((SECONDS-t0))s
