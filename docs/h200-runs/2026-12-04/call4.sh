# session 12-04 call 4: cuBLAS split-K at the 31B batch-1 shapes under three workspace settings; clean c1 TPOT
# (FlashInfer vs Triton decode, no profiler); DOT_ROW_MASK off / on at 31B NVFP4 c96
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
( timeout 40 python3 .carry/splitk.py; CUBLAS_WORKSPACE_CONFIG=:0:0 timeout 40 python3 .carry/splitk.py; CUBLASLT_WORKSPACE_SIZE=0 CUBLAS_WORKSPACE_CONFIG=:0:0 timeout 40 python3 .carry/splitk.py ) > $OUT/4-splitk.jsonl 2> $OUT/4-splitk.err; echo splitk $((SECONDS-t0))s
python3 -c "
import json,os
for l in open(os.environ['OUT']+'/4-splitk.jsonl'):
    r=json.loads(l); print(r['env'], r['shape'], r['us'], r['bound_us'], len(r['kernels']), r['kernels'][0][:40], r['max_abs_err'])
"
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 150 python3 -m perfkit run configs/ab_decode_attention.yaml --set "$S" --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/4-ab.log | head -5
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
S='scenarios=[{name: c96, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 96}, num_requests: 96, warmup_requests: 8}]'
for arm in old new; do
t0=$SECONDS
timeout -s INT 130 python3 .carry/arm.py $arm run configs/b200_nvfp4.yaml --out $OUT/r_$arm --set "$M" --set "$S" --set runtime.max_batch_size=96 > $OUT/4-rowmask_$arm.log 2>&1; echo rowmask $arm rc=$? $((SECONDS-t0))s; grep -iE "error" $OUT/4-rowmask_$arm.log | head -3
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete; find $OUT -name "*.trace.json" -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-ab_c1.json; rm -rf $OUT/ab
for d in r_old r_new; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-$d.json; rm -rf $OUT/$d; done
python3 -m perfkit compare $OUT/4-ab_c1.json --markdown $OUT/4-compare_c1.md > /dev/null 2>&1; grep -E "TPOT p50|forward_decode device|clock|^#" $OUT/4-compare_c1.md | head -12
python3 -m perfkit compare $OUT/4-r_old.json $OUT/4-r_new.json --markdown $OUT/4-compare_rowmask.md > /dev/null 2>&1; grep -E "TPOT p50|output thr|forward_(decode|prefill) device|clock|^#" $OUT/4-compare_rowmask.md | head -12
