#!/bin/bash
# 12-07 call 1: the GPU test files not run since 12-04/05, the gemv preload-2 sweep (26B-A4B shapes, PDL), a 26B-A4B c1
# torch profile with pdl off (per-kernel times not stretched by PDL's early launch), then the JIT cache
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kv_fp8.py tests/test_fp8_gemv.py tests/test_stream.py tests/test_jit_log.py tests/test_gemma_mask.py tests/test_engine_fused.py tests/test_gemv.py > $OUT/1-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -1 $OUT/1-gpu_tests.log
timeout 120 python3 -m perfkit.kernels.gemv --pdl --preload --only 26b-a4b --out $OUT/1-gemv_preload.jsonl > $OUT/1-gemv_preload.log 2>&1; echo gemv rc=$? $((SECONDS-t0))s; grep bound $OUT/1-gemv_preload.log
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 2, warmup_requests: 1}]'
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, device: cuda}]'
timeout -s INT 120 python3 -m perfkit run configs/ab_pdl.yaml --set "$M" --set "$S" --set repeats=1 --set "arms=[]" --set toggles.pdl=off --profile torch --out $OUT/p > $OUT/1-profile.log 2>&1; echo profile rc=$? $((SECONDS-t0))s
grep -E "TPOT|rror" $OUT/1-profile.log | head -5
for f in $(find $OUT/p -name result.json); do cp $f $OUT/1-profile_26b_c1.json; done
rm -rf $OUT/p
save_jit_cache $OUT
ls -la $OUT
