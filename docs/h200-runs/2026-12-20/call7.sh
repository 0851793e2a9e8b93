source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout -s INT 125 python3 -m pytest -v -m gpu tests/test_decode_io.py -k "large_batches" -p no:cacheprovider --durations=3 > $OUT/7-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; grep -E "PASSED|FAILED|Error" $OUT/7-tests.log | head -5; tail -2 $OUT/7-tests.log
