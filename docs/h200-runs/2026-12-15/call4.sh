source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches, toggles: {decode_moe_ffn: branches}}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 250 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --set "$A" --set "$S" --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/4-ab_26b_c1.json; done; rm -rf $OUT/ab
grep "│ " $OUT/4-ab.log | grep -v scenario | cut -c1-160 | head -12
