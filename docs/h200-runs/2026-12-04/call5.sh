# session 12-04 call 5: the sandwich norm's warps at batch 1; then 31B c1 with the best cap against the rule,
# old / new / new / old as separate runs
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 90 python3 .carry/norm_sweep.py $OUT/5-choice.json > $OUT/5-norm_sweep.jsonl 2> $OUT/5-norm_sweep.err; echo sweep rc=$? $((SECONDS-t0))s; cat $OUT/5-norm_sweep.jsonl; tail -2 $OUT/5-norm_sweep.err
CAP=$(python3 -c "import json,os;print(json.load(open(os.environ['OUT']+'/5-choice.json'))['cap'])")
if [ "$CAP" != "16" ]; then
M='models=[{preset: 31b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 4, warmup_requests: 1}]'
i=0
for arm in old new new old; do
i=$((i+1)); t0=$SECONDS
timeout -s INT 75 python3 .carry/arm5.py $arm $OUT/5-choice.json run configs/ab_decode_attention.yaml --set "$M" --set "$S" --set arms=[] --set repeats=1 --out $OUT/w$i > $OUT/5-w$i-$arm.log 2>&1; echo $arm rc=$? $((SECONDS-t0))s; grep -iE "error|new arm" $OUT/5-w$i-$arm.log | head -3
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for i in 1 2 3 4; do R=$(find $OUT/w$i -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-w$i.json; rm -rf $OUT/w$i; done
python3 - <<'PY'
import json, os
for i, arm in zip(range(1, 5), ("old", "new", "new", "old")):
    try:
        r = json.load(open(f"{os.environ['OUT']}/5-w{i}.json"))
    except OSError:
        continue
    s = r["scenarios"][0]
    print(arm, "TPOT p50", round(s["metrics"]["tpot_ms"]["p50"], 3) if "tpot_ms" in s["metrics"] else list(s["metrics"])[:5],
          "forward_decode", round(s["nvtx"]["forward_decode"]["device_mean_ms"], 3))
PY
fi
