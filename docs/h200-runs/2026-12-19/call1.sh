source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout -s INT 320 python3 -m pytest -q -m gpu tests/test_quant.py tests/test_fp8_gemv.py tests/test_pdl.py tests/test_engine_gpu.py --durations=12 -p no:cacheprovider > $OUT/1-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-tests.log
t0=$SECONDS
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 4, warmup_requests: 1}]'
timeout -s INT 200 python3 -c "import sys; sys.argv=['perfkit']+sys.argv[1:]; from perfkit.cli import app; app()" run configs/h200_26b.yaml --out $OUT/p26 --set "$S" --set capture.profile=torch --set capture.profile_scenario=c1 --set "capture.profile_steps=[40, 44]" > $OUT/1-p26.log 2>&1
echo p26 rc=$? $((SECONDS-t0))s; grep -E "c1 \[" $OUT/1-p26.log | cut -c1-160
R=$(find $OUT/p26 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/1-p26.json
T=$(find $OUT/p26 -name "*.trace.json" | head -1); [ -n "$T" ] && xz -T4 -c $T > $OUT/1-p26.trace.json.xz
rm -rf $OUT/p26
ls -la $OUT
