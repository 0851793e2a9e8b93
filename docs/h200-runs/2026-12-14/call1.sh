source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-14
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $OUT/1-gpu.txt
python3 $D/tma_probe.py check > $OUT/1-check.txt 2>&1
timeout -s INT 400 python3 $D/tma_probe.py time > $OUT/1-tma.jsonl 2> $OUT/1-tma.err
tail -3 $OUT/1-tma.err
cat $OUT/1-check.txt $OUT/1-tma.jsonl
