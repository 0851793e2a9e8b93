# session 12-02 call 2: MoE SCALES_VEC tile sweep at T=64; 31B NVFP4 c128 A/B of the W4A16 M>64 defaults
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 230 python3 .carry/p8/vec_sweep.py > $OUT/2-moe_vec_T64.jsonl 2> $OUT/2-moe_vec.err; echo vec rc=$? $((SECONDS-t0))s; tail -2 $OUT/2-moe_vec.err
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/2-moe_vec_T64.jsonl") if l.startswith("{")]
for st in ("gate_up", "down"):
    r = sorted([x for x in rows if x["stage"] == st and "graph_us" in x], key=lambda x: x["graph_us"])
    for x in r[:5]: print(st, x["graph_us"], x["tiles"])
    for x in rows[:4]:
        if x["stage"] == st: print("  first", x.get("graph_us"), x["tiles"])
PY
S='scenarios=[{name: c128, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 128}, num_requests: 256, warmup_requests: 8}]'
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
for arm in old new; do
t0=$SECONDS
timeout -s INT 150 python3 .carry/p8/arm.py $arm run configs/b200_nvfp4.yaml --out $OUT/n_$arm --set "$M" --set "$S" --set runtime.max_batch_size=128 > $OUT/2-31b_c128_$arm.log 2>&1; echo 31b $arm rc=$? $((SECONDS-t0))s; grep -iE "error" $OUT/2-31b_c128_$arm.log | head -3
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in n_old n_new; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/2-$d.json; rm -rf $OUT/$d; done
python3 -m perfkit compare $OUT/2-n_old.json $OUT/2-n_new.json > $OUT/2-compare_31b_c128.md 2>&1; grep -E "TPOT p50|TTFT p50|output thr|forward_(decode|prefill) device|clock|·" $OUT/2-compare_31b_c128.md | head -12
