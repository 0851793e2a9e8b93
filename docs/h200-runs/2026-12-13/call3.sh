# session 12-13 call 3: the wide W4A16 gemv split over K in one launch (the last program of a row block reduces);
# the FFN branches above 8 rows (FFN_BRANCH_MAX_ROWS patched to 64) at c8 / c16 / c32 against separate
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 150 python3 docs/h200-runs/2026-12-13/w4a16_probe.py chain split > $OUT/3-w4a16_split.jsonl 2> $OUT/3-w4a16_split.err
echo chain rc=$? $((SECONDS-t0))s; tail -3 $OUT/3-w4a16_split.err
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/3-w4a16_split.jsonl"):
    r = json.loads(l)
    print(r["N"], r["K"], "stream one/chain", r["stream_one_us"], r["stream_chain_us"], {k: (v.get("chain_us"), v.get("one_us"), v.get("rel"), v.get("error", "")[:60]) for k, v in r.items() if isinstance(v, dict)})
PY
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches64, toggles: {decode_moe_ffn: branches}}]'
S='scenarios=[{name: c8, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 8}, num_requests: 8, warmup_requests: 1}, {name: c16, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}, {name: c32, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 1}]'
timeout -s INT 330 python3 -c "import sys, perfkit.runtime.model as m; m.FFN_BRANCH_MAX_ROWS = 64; from perfkit.cli import app; sys.argv[0] = 'perfkit'; app()" \
  run configs/ab_decode_moe_ffn.yaml --set "$A" --set "$S" --set runtime.max_batch_size=32 --set repeats=1 --out $OUT/ab > $OUT/3-ab.log 2>&1
echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/3-ab_rows64.json; done; rm -rf $OUT/ab
grep "│ " $OUT/3-ab.log | grep -v scenario | cut -c1-140; tail -3 $OUT/3-ab.log
echo done $((SECONDS-t0))s
