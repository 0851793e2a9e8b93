source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 220 python3 -m pytest -q -m gpu tests/test_quant.py -k "repacked_words" > $OUT/2-tests.log 2>&1
tail -3 $OUT/2-tests.log
timeout -s INT 330 python3 -m perfkit run configs/ab_w4a16_words.yaml --out /tmp/r > $OUT/2-ab.log 2>&1
tail -25 $OUT/2-ab.log
R=$(ls -d /tmp/r/*/ | head -1)
cp $R/result.json $OUT/2-ab_w4a16_words.json
python3 -m perfkit compare $OUT/2-ab_w4a16_words.json --markdown $OUT/2-compare.md > /dev/null 2>&1; head -40 $OUT/2-compare.md
