#!/bin/bash
# 12-11 call 2: decode_moe_ffn's GPU tests, the gather kernels after their bodies became jit helpers, the one
# paged_decode test call 1 cut off; then ab_decode_moe_ffn (26B-A4B c1 / c4, separate vs fused).
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_ffn.py tests/test_pdl.py tests/test_kernels_fused.py -k "moe_ffn or block or moe or gather or sandwich or norm or pdl" > $OUT/2-ffn.log 2>&1; echo "ffn rc=$? $((SECONDS-t0))s"; tail -n 4 $OUT/2-ffn.log
timeout -s INT 200 python3 -m perfkit run configs/ab_decode_moe_ffn.yaml --out $OUT/ab > $OUT/2-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/2-ab_decode_moe_ffn.json; done; rm -rf $OUT/ab
grep "│ " $OUT/2-ab.log | grep -v scenario | cut -c1-130
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_decode.py -k "kv_shared_layers_lockstep" > $OUT/2-pd.log 2>&1; echo "pd rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/2-pd.log
echo done $((SECONDS-t0))s
