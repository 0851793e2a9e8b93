source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
timeout -s INT 420 python3 -m pytest -q -m gpu tests/test_quant.py tests/test_pdl.py -k "not engine_tokens or nvfp4" > $OUT/7-tests.log 2>&1
tail -5 $OUT/7-tests.log
grep -E "M=8|M=1:|M=300" $OUT/7-tests.log | head
