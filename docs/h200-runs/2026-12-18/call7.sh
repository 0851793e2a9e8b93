source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-18
timeout -s INT 80 python3 $D/groups_probe.py > $OUT/7-groups.jsonl 2> $OUT/7-groups.err
tail -2 $OUT/7-groups.err; cat $OUT/7-groups.jsonl
S='scenarios=[{name: c32, workload: {isl: 1024, osl: 128, seed: 6}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 1}]'
A='arms=[{name: auto, toggles: {w4a16_words: auto}}]'
MF='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: fp8, device: cuda}]'
for arm in nv_new nv_old f8_new f8_old; do
t0=$SECONDS
case $arm in nv_*) CFG=configs/ab_w4a16_words.yaml; X="--set";; f8_*) CFG=configs/h200_quant.yaml; X="--set";; esac
if [ ${arm%_*} = nv ]; then EXTRA="$A"; else EXTRA="$MF"; fi
timeout -s INT 80 python3 -c "import sys, perfkit.kernels.w4a16_gemm as W, perfkit.kernels.fp8_gemv as F; old = sys.argv[1].endswith('old'); W.GEMV_TC_MAX_M = 16 if old else W.GEMV_TC_MAX_M; F.GEMV_TC_MAX_M = 16 if old else F.GEMV_TC_MAX_M; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run $CFG --out $OUT/e_$arm --set "$S" --set "$EXTRA" --set runtime.max_batch_size=32 --set repeats=1 > $OUT/7-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -E "c32 \[" $OUT/7-$arm.log | cut -c1-140
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/e_$arm -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/7-e_$arm.json; rm -rf $OUT/e_$arm
done
