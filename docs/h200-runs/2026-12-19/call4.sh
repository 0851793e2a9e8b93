source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout -s INT 60 python3 -m pytest -q -m gpu tests/test_quant.py tests/test_fp8_gemv.py -k "rows or groups or fp8_linear_gemv or real_shapes" -p no:cacheprovider > $OUT/4-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; grep -E "FAILED|ERROR" $OUT/4-tests.log | head -5; tail -1 $OUT/4-tests.log
S32='{name: c32, workload: {isl: 1024, osl: 128, seed: 6}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 1}'
S64='{name: c64, workload: {isl: 1024, osl: 128, seed: 7}, arrival: {kind: closed, concurrency: 64}, num_requests: 64, warmup_requests: 1}'
A='arms=[{name: auto, toggles: {w4a16_words: auto}}]'
MF='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: fp8, device: cuda}]'
for arm in nv_new nv_old f8_new; do
t0=$SECONDS
case $arm in nv_*) CFG=configs/ab_w4a16_words.yaml; EXTRA="$A"; S="scenarios=[$S32, $S64]"; MB=64;; f8_*) CFG=configs/h200_quant.yaml; EXTRA="$MF"; S="scenarios=[$S32]"; MB=32;; esac
timeout -s INT 115 python3 -c "import sys, perfkit.kernels.w4a16_gemm as W, perfkit.kernels.fp8_gemv as F; old = sys.argv[1].endswith('old'); W.GEMV_TC_COLS_CONFIG = W.GEMV_TC_CONFIG if old else W.GEMV_TC_COLS_CONFIG; W.GEMV_TC_MAX_M = 32 if old else W.GEMV_TC_MAX_M; F.GEMV_TC_COLS_CONFIG = F.GEMV_TC_ROWS_CONFIG if old else F.GEMV_TC_COLS_CONFIG; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run $CFG --out $OUT/e_$arm --set "$S" --set "$EXTRA" --set runtime.max_batch_size=$MB --set repeats=1 > $OUT/4-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -E "c32 \[|c64 \[" $OUT/4-$arm.log | cut -c1-140
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/e_$arm -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-e_$arm.json; rm -rf $OUT/e_$arm
done
