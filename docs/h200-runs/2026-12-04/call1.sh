# session 12-04 call 1: old vs new merge of the Triton decode (+ tiles), then the owed GPU tests
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 170 python3 .carry/merge_ab.py > $OUT/1-merge_ab.jsonl 2> $OUT/1-merge_ab.err; echo merge_ab rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-merge_ab.err
python3 - <<'PY'
import json, os, collections
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/1-merge_ab.jsonl") if l.startswith("{")]
by = collections.defaultdict(list)
for r in rows:
    by[(r["preset"], r["pool"], r["batch"])].append(r)
for k, rs in by.items():
    f = lambda a: [r["us"] for r in rs if r["arm"] == a and r["impl"] == "triton"]
    fi = {r["impl"]: r["us"] for r in rs if r["arm"] == "flashinfer"}
    t = sorted((r["us"], r["impl"], r["splits"]) for r in rs if r["arm"] in ("new_tiles",) and r["us"])
    print(k, "bound", rs[0]["bound_us"], "fi", fi, "old", f("old"), "new", f("new"), "best tile", t[:1], "diff", max((r["max_abs_diff"] or 0) for r in rs))
PY
t0=$SECONDS
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_decode.py tests/test_attention_sweep.py tests/test_engine_gpu.py tests/test_[l-z]*.py > $OUT/1-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; grep -E "passed|failed|Error |assert" $OUT/1-gpu_tests.log | head -12
save_jit_cache $OUT
