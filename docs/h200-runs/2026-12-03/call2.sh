# session 12-03 call 2: the Triton decode kernel on the GPU: its tests, a tile / split sweep vs FlashInfer, the engine A/B
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/test_paged_decode.py > $OUT/2-gpu_tests_decode.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; grep -E "passed|failed|Error|assert" $OUT/2-gpu_tests_decode.log | head -12
t0=$SECONDS
timeout 130 python3 -c "
import perfkit.kernels.paged_decode as P
P.sweep(batches=(1, 2, 4, 8, 16, 64), tiles=[dict(block_n=16, num_warps=4), dict(block_n=32, num_warps=4), dict(block_n=64, num_warps=4), dict(block_n=32, num_warps=8)])
" > $OUT/2-decode_sweep.jsonl 2> $OUT/2-decode_sweep.err; echo sweep rc=$? $((SECONDS-t0))s; tail -3 $OUT/2-decode_sweep.err
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/2-decode_sweep.jsonl") if l.startswith("{")]
keys = sorted({(r["preset"], r["pool"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
for k in keys:
    rs = [r for r in rows if (r["preset"], r["pool"], r["batch"]) == k]
    fi = min((r for r in rs if r["impl"] != "triton"), key=lambda r: r["us"])
    tr = sorted((r for r in rs if r["impl"] == "triton"), key=lambda r: r["us"])
    d = [r for r in tr if r["block_n"] == 32 and r["num_warps"] == 4 and r["programs_per_sm"] == 2]
    best = tr[0] if tr else None
    print(k, "bound", fi["bound_us"], "| fi", fi["impl"], fi["us"], "| default", d[0]["us"] if d else None,
          "| best", best and (best["us"], best["block_n"], best["num_warps"], best["programs_per_sm"], best["splits"]),
          "| err", max(r["max_abs_err"] for r in rs))
PY
t0=$SECONDS
timeout -s INT 230 python3 -m perfkit run configs/ab_decode_attention.yaml --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/2-ab.log | head -5
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/2-ab_decode_attention.json; rm -rf $OUT/ab
python3 -m perfkit compare $OUT/2-ab_decode_attention.json --markdown $OUT/2-compare.md > $OUT/2-compare.txt 2>&1; grep -E "TPOT p50|forward_decode device|clock|^#|c1|c4|c8" $OUT/2-compare.md | head -40
save_jit_cache $OUT
