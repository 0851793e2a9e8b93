# session 12-13 call 2: W4A16 wide kernel with a 4-D tile (4 rows x 8 chunks per warp: fewer distinct x chunks
# per load); L2 prefetch with smaller spans; ncu of the 4-D tile at 5376 x 16384
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 docs/h200-runs/2026-12-13/w4a16_probe.py chain q > $OUT/2-w4a16_q.jsonl 2> $OUT/2-w4a16_q.err
echo chain rc=$? $((SECONDS-t0))s; tail -3 $OUT/2-w4a16_q.err
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/2-w4a16_q.jsonl"):
    r = json.loads(l)
    print(r["N"], r["K"], "stream chain", r["stream_chain_us"], {k: (v.get("chain_us"), v.get("one_us")) for k, v in r.items() if isinstance(v, dict)})
PY
timeout 120 python3 docs/h200-runs/2026-12-13/prefetch_probe.py > $OUT/2-prefetch.jsonl 2> $OUT/2-prefetch.err
echo prefetch rc=$? $((SECONDS-t0))s; tail -3 $OUT/2-prefetch.err; grep arm $OUT/2-prefetch.jsonl; grep -v '"qkv_max_abs": 0.0' $OUT/2-prefetch.jsonl | grep check
echo done $((SECONDS-t0))s
