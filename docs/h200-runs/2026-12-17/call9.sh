source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-17
timeout -s INT 70 python3 $D/rp_probe.py rows --shapes 8192,2816 2816,4096 4224,2816 2816,2112 9216,2816 2816,8192 --ms 2 4 8 16 > $OUT/9-rows26.jsonl 2> $OUT/9-rows26.err
tail -2 $OUT/9-rows26.err; cat $OUT/9-rows26.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['N'],r['K'],r['M'],r['tc'],'tc',min(r['std_us_0'],r['std_us_1']),'rp',min(r['repack_us_0'],r['repack_us_1']),'dot',min(r['dot_us_0'],r['dot_us_1']))"
timeout -s INT 100 python3 -m pytest -q -m gpu tests/test_quant.py -k "tc_rows" > $OUT/9-tests.log 2>&1
tail -3 $OUT/9-tests.log
