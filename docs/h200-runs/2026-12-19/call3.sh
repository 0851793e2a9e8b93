source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout -s INT 200 python3 docs/h200-runs/2026-12-19/cols_probe.py > $OUT/3-cols.jsonl 2> $OUT/3-cols.err
echo probe rc=$? $((SECONDS-t0))s; tail -3 $OUT/3-cols.err; cat $OUT/3-cols.jsonl
t0=$SECONDS
timeout -s INT 200 python3 -m pytest -v -m gpu tests/test_paged_decode.py -k "prologue or real_shapes" -p no:cacheprovider > $OUT/3-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; grep -E "FAILED|ERROR" $OUT/3-tests.log | head; tail -1 $OUT/3-tests.log
