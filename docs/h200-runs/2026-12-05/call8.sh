# session 12-05 call 8: GPU tests after the sliding-pool split rule (paged decode kernel + engine lockstep)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_decode.py tests/test_attention_sweep.py tests/test_engine_gpu.py -k "paged or decode or sweep or fused_kernels or graphs_on_vs_off" > $OUT/8-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/8-gpu_tests.log
