source .carry/bootstrap.sh
timeout 120 python3 -m pytest -q -m gpu tests/test_fp8_gemv.py > $OUT/7-tests.log 2>&1
tail -2 $OUT/7-tests.log
