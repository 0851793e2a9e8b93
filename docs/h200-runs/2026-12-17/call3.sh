source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-17
timeout -s INT 200 python3 $D/rp_probe.py rows --shapes 5376,21504 16384,5376 5376,8192 --ms 2 4 8 16 > $OUT/3-rows.jsonl 2> $OUT/3-rows.err
tail -3 $OUT/3-rows.err; cat $OUT/3-rows.jsonl
