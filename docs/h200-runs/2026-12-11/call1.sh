#!/bin/bash
# 12-11 call 1: the GPU tests owed since 12-10's review commit (the plain decode kernel's loop in helpers, the
# engine), then the PDL suspect probe (prologue_gemv_probe.py).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_decode.py > $OUT/1-pd.log 2>&1; echo "pd rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/1-pd.log
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_fusion.py tests/test_pdl.py > $OUT/1-df.log 2>&1; echo "df rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/1-df.log
timeout 60 python3 docs/h200-runs/2026-12-10/prologue_gemv_probe.py > $OUT/1-gemv_probe.jsonl 2> $OUT/1-gemv_probe.err; echo "probe rc=$? $((SECONDS-t0))s"
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/1-gemv_probe.jsonl"):
    r = json.loads(l); print({k: v for k, v in r.items() if k != "check"})
PY
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py > $OUT/1-eng.log 2>&1; echo "eng rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/1-eng.log
echo done $((SECONDS-t0))s
