source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-16
timeout -s INT 100 python3 $D/repack_probe.py --plain --shapes 43008,5376 18432,5376 16384,5376 > $OUT/9-repack_plain.jsonl 2> $OUT/9-repack_plain.err
tail -3 $OUT/9-repack_plain.err
cat $OUT/9-repack_plain.jsonl
