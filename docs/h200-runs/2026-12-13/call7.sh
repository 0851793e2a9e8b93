# session 12-13 call 7: the tensor-core W4A16 prototype at M = 1 (mma_compile_probe.py) in a chain against the gemv
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 150 python3 docs/h200-runs/2026-12-13/mma_compile_probe.py time > $OUT/7-mma.jsonl 2> $OUT/7-mma.err
echo "mma rc=$? $((SECONDS-t0))s"; tail -3 $OUT/7-mma.err; cat $OUT/7-mma.jsonl
