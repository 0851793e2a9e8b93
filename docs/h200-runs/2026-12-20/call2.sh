source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout -s INT 200 python3 -m pytest -v -m gpu tests/test_decode_io.py -p no:cacheprovider --durations=8 > $OUT/2-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; grep -cE "PASSED" $OUT/2-tests.log; grep -E "FAILED|ERROR|Error" $OUT/2-tests.log | head; tail -2 $OUT/2-tests.log
t0=$SECONDS
timeout -s INT 340 python3 -c "import sys; sys.argv=['perfkit']+sys.argv[1:]; from perfkit.cli import app; app()" run configs/ab_decode_io.yaml --out $OUT/ab > $OUT/2-ab.log 2>&1
echo ab rc=$? $((SECONDS-t0))s; grep -E "\] *:|TPOT" $OUT/2-ab.log | cut -c1-150 | head -20
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/2-ab_decode_io.json; rm -rf $OUT/ab
