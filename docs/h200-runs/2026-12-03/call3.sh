# session 12-03 call 3: the rest of the decode kernel's GPU tests; the owed test_kv_fp8 + test_quant at HEAD
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_paged_decode.py -k "graph_replay or fp8_kv or toggle" > $OUT/3-gpu_tests_decode.log 2>&1; echo decode tests rc=$? $((SECONDS-t0))s; tail -4 $OUT/3-gpu_tests_decode.log
t0=$SECONDS
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_kv_fp8.py tests/test_quant.py > $OUT/3-gpu_tests_kv_quant.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -4 $OUT/3-gpu_tests_kv_quant.log
