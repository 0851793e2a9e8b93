source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-14
python3 $D/tc_probe.py check > $OUT/2-check.txt 2>&1
timeout -s INT 420 python3 $D/tc_probe.py time > $OUT/2-tc.jsonl 2> $OUT/2-tc.err
tail -3 $OUT/2-tc.err
cat $OUT/2-check.txt $OUT/2-tc.jsonl
