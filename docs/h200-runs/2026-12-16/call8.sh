source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-16
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 150 python3 $D/repack_probe.py --regs --shapes 43008,5376 18432,5376 16384,5376 5376,8192 > $OUT/8-repack.jsonl 2> $OUT/8-repack.err
tail -3 $OUT/8-repack.err
cat $OUT/8-repack.jsonl
