# session 12-03 call 1: the owed GPU tests at HEAD ([a-k] + test_quant), DOT_ROW_MASK timing, MoE candidate tiles
export PERFKIT_GIT_SHA=9d06059b
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
t0=$SECONDS
timeout 360 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_[a-k]*.py tests/test_quant.py > $OUT/1-gpu_tests_ak.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-gpu_tests_ak.log
t0=$SECONDS
timeout 60 python3 -c "
import perfkit.kernels.w4a16_gemm as W
for flag in (False, True):
    W.DOT_ROW_MASK = flag
    print('# DOT_ROW_MASK', flag)
    W.sweep_w4a16(shapes=[(m, 43008, 5376) for m in (32, 96, 128)], paths=('dot',), configs={'dot': (W.DOT_LARGE_CONFIG,)})
" > $OUT/1-rowmask.jsonl 2>&1; echo rowmask rc=$? $((SECONDS-t0))s
t0=$SECONDS
timeout 110 python3 -m perfkit.kernels.moe --tiles --quant nvfp4 --candidates --tokens 64 > $OUT/1-moe_cand.jsonl 2>&1; echo cand rc=$? $((SECONDS-t0))s
save_jit_cache $OUT
