source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-16
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 200 python3 $D/split_probe.py > $OUT/3-split.jsonl 2> $OUT/3-split.err
tail -3 $OUT/3-split.err
python3 -c "
import json
for l in open('$OUT/3-split.jsonl'):
    r = json.loads(l); print({k: v for k, v in r.items() if not k.endswith('_ok')}, all(v for k, v in r.items() if k.endswith('_ok')))
"
timeout 150 python3 -m pytest -q tests/test_quant.py -k "gemv_tc or pdl_chain or default_tiles" > $OUT/3-tests.log 2>&1
tail -3 $OUT/3-tests.log
