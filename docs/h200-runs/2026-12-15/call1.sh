source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-15
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 240 python3 $D/pdl_probe.py > $OUT/1-pdl.jsonl 2> $OUT/1-pdl.err
tail -3 $OUT/1-pdl.err
python3 -c "
import json
for l in open('$OUT/1-pdl.jsonl'):
    r = json.loads(l); print({k: v for k, v in r.items() if not k.endswith('equal')}, all(v for k, v in r.items() if k.endswith('equal')))
"
timeout 230 python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_stream.py tests/test_quant.py -k "pdl or stream or gemv_tc" > $OUT/1-tests.log 2>&1
tail -3 $OUT/1-tests.log
