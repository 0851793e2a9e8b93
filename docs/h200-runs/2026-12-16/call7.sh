source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-16
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 200 python3 $D/repack_probe.py > $OUT/7-repack.jsonl 2> $OUT/7-repack.err
tail -3 $OUT/7-repack.err
python3 -c "
import json
for l in open('$OUT/7-repack.jsonl'):
    print(json.loads(l))
"
