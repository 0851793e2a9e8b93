# session 12-04 call 3: perfkit kernels attention (the CLI's triton path, final merge) at both models' pools; the
# engine A/B FlashInfer vs Triton decode at c1 / c4 with a torch profile window per (scenario, arm, repeat)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
for p in 31b 26b-a4b; do
t0=$SECONDS
timeout 80 python3 -m perfkit kernels attention --preset $p --batch-sizes 1,2,4,8 --kv-lens 1024 --prefill-q-lens 0 --prefill-impl "" --decode-impl cuda_cores,tc_fa2,triton --triton-tiles 32x4x2,32x4x4,64x4x2 --repeats 30 --out $OUT/k > $OUT/3-attn_$p.log 2>&1; echo attn $p rc=$? $((SECONDS-t0))s; grep -E "decode .* b1 |error|Error" $OUT/3-attn_$p.log | head -12
R=$(find $OUT/k -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/3-attn_$p.json; rm -rf $OUT/k
done
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 2, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 300 python3 -m perfkit run configs/ab_decode_attention.yaml --set "$S" --profile torch --out $OUT/ab > $OUT/3-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/3-ab.log | head -5
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/3-ab_c1_c4_profile.json; rm -rf $OUT/ab
python3 -m perfkit compare $OUT/3-ab_c1_c4_profile.json --markdown $OUT/3-compare.md > /dev/null 2>&1; grep -E "TPOT p50|forward_decode device|clock|^#|profile" $OUT/3-compare.md | head -40
