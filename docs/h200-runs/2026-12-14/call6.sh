source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
timeout -s INT 250 python3 docs/h200-runs/2026-12-14/tc_split_sweep.py > $OUT/6-split.jsonl 2> $OUT/6-split.err
tail -3 $OUT/6-split.err; cat $OUT/6-split.jsonl
