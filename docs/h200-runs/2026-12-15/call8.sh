source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 300 python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_stream.py > $OUT/8-tests.log 2>&1
tail -3 $OUT/8-tests.log; echo tests $((SECONDS-t0))s
