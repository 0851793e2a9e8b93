#!/bin/bash
# 12-12 call 4: decode_moe_ffn=branches' GPU tests (and test_moe_ffn's after the toggle became a string), then
# ab_decode_moe_ffn separate vs branches (26B-A4B c1 / c4).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ffn_branches.py tests/test_moe_ffn.py > $OUT/4-tests.log 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -n 4 $OUT/4-tests.log
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches, toggles: {decode_moe_ffn: branches}}]'
timeout -s INT 260 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$A" --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_decode_moe_ffn.json; done; rm -rf $OUT/ab
grep "│ " $OUT/4-ab.log | grep -v scenario | cut -c1-150
echo done $((SECONDS-t0))s
