source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-18
timeout -s INT 240 python3 $D/tile_probe.py > $OUT/5-tiles.jsonl 2> $OUT/5-tiles.err
tail -3 $OUT/5-tiles.err; python3 -c "
import json
for l in open('$OUT/5-tiles.jsonl'):
    r=json.loads(l); print(r.get('N'),r.get('K'),r.get('M'),r.get('config'),r.get('splits_run'),r.get('us'),r.get('pct'),r.get('rel_err'),r.get('error','')[:100], r.get('counts_zero',''))"
