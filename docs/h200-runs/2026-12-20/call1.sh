source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout -s INT 430 python3 -m pytest -v -m gpu tests/test_pdl.py tests/test_engine_gpu.py -p no:cacheprovider --durations=8 > $OUT/1-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; grep -cE "PASSED" $OUT/1-tests.log; grep -E "FAILED|ERROR" $OUT/1-tests.log | head; tail -2 $OUT/1-tests.log
save_jit_cache $OUT
ls -la $OUT
