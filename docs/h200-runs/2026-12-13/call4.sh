# session 12-13 call 4: GPU tests of the FFN branches at up to 32 rows; ab_decode_moe_ffn separate vs branches at
# c16 / c32 on the committed default (FFN_BRANCH_MAX_ROWS 32), 2 repeats
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ffn_branches.py tests/test_moe_ffn.py > $OUT/4-tests.log 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -n 3 $OUT/4-tests.log
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches, toggles: {decode_moe_ffn: branches}}]'
S='scenarios=[{name: c16, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}, {name: c32, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 1}]'
timeout -s INT 300 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$A" --set "$S" --set runtime.max_batch_size=32 --out $OUT/ab > $OUT/4-ab.log 2>&1
echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_c16_c32.json; done; rm -rf $OUT/ab
grep "│ " $OUT/4-ab.log | grep -v scenario | cut -c1-140; tail -2 $OUT/4-ab.log
echo done $((SECONDS-t0))s
