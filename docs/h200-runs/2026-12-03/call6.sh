# session 12-03 call 6: the fused merge on the GPU (correctness at real shapes and under graph replays, then timed)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 75 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_paged_decode.py -k "real_shapes or graph_replay" > $OUT/6-gpu_tests_fused.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/6-gpu_tests_fused.log
t0=$SECONDS
timeout 60 python3 -c "
import perfkit.kernels.paged_decode as P
P.sweep(batches=(1, 2, 4, 8), tiles=[dict(block_n=32, num_warps=4, fused_merge=False), dict(block_n=32, num_warps=4, fused_merge=True)], programs_per_sm=(2,))
" > $OUT/6-fused_sweep.jsonl 2> $OUT/6-fused_sweep.err; echo sweep rc=$? $((SECONDS-t0))s; tail -2 $OUT/6-fused_sweep.err
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/6-fused_sweep.jsonl"):
    r = json.loads(l)
    print(r["preset"], r["pool"], r["batch"], r["impl"], r.get("fused_merge", ""), r["us"], round(r["max_abs_err"], 4))
PY
