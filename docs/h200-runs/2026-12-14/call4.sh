source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-14
timeout 200 python3 -m pytest -q tests/test_quant.py -k "gemv_tc or gpu_w4a16_default_tiles or gpu_31b_two_layers_quantized" > $OUT/4-tests.log 2>&1
tail -5 $OUT/4-tests.log
timeout -s INT 330 python3 $D/tc_probe.py time > $OUT/4-tc.jsonl 2> $OUT/4-tc.err
tail -3 $OUT/4-tc.err
cat $OUT/4-tc.jsonl
