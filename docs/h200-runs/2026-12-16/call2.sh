source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-16
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 120 python3 -m pytest -q tests/test_quant.py -k "gemv_tc_decode or gemv_tc_matches or gemv_tc_real or pdl_chain or default_tiles" > $OUT/2-tests.log 2>&1
tail -3 $OUT/2-tests.log
timeout -s INT 200 python3 $D/cols_probe.py > $OUT/2-cols.jsonl 2> $OUT/2-cols.err
tail -3 $OUT/2-cols.err
python3 -c "
import json
for l in open('$OUT/2-cols.jsonl'):
    r = json.loads(l); print(r)
"
