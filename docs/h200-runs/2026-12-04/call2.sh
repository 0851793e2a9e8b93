# session 12-04 call 2: merge variants; the engine A/B of the decode kernels at c16 / c32; the GPU tests call 1's timeout cut
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 120 python3 .carry/merge_var.py > $OUT/2-merge_var.jsonl 2> $OUT/2-merge_var.err; echo merge_var rc=$? $((SECONDS-t0))s; tail -3 $OUT/2-merge_var.err
python3 - <<'PY'
import json, os, collections
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/2-merge_var.jsonl") if l.startswith("{")]
by = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows:
    by[(r["preset"], r["pool"], r["batch"], r["splits"])][r["arm"]].append(r["us"])
for k, arms in by.items():
    print(k, " ".join(f"{a} {'/'.join(map(str, v))}" for a, v in arms.items()))
print("max diff", max((r["max_abs_diff"] or 0) for r in rows), "errors", [r["message"] for r in rows if r["status"] != "ok"][:2])
PY
t0=$SECONDS
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider "tests/test_quant.py::test_gpu_quantized_experts_real_shapes_and_graph_capture[fp8]" tests/test_quant.py::test_gpu_nvfp4_gather_kernels_real_shapes_and_graph_capture tests/test_stream.py tests/test_syncs.py tests/test_vision_gpu.py > $OUT/2-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -2 $OUT/2-gpu_tests.log
S='scenarios=[{name: c16, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}, {name: c32, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 250 python3 -m perfkit run configs/ab_decode_attention.yaml --set "$S" --set runtime.max_batch_size=32 --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/2-ab.log | head -5
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/2-ab_c16_c32.json; rm -rf $OUT/ab
python3 -m perfkit compare $OUT/2-ab_c16_c32.json --markdown $OUT/2-compare.md > /dev/null 2>&1; grep -E "TPOT p50|forward_decode device|clock|^#" $OUT/2-compare.md | head -30
