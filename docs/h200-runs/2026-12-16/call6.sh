source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
python3 - > /tmp/s.txt <<'PY'
import yaml
c = yaml.safe_load(open("configs/b200_nvfp4.yaml"))
import json
print(json.dumps([s for s in c["scenarios"] if s["name"] != "c1024"]))
PY
S="scenarios=$(cat /tmp/s.txt)"
t0=$SECONDS
timeout -s INT 480 python3 -m perfkit run configs/b200_nvfp4.yaml --out $OUT/b31 --set "$M" --set "$S" > $OUT/6-b31.log 2>&1
echo rc=$? $((SECONDS-t0))s
tail -14 $OUT/6-b31.log
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/b31 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/6-b200_31b.json; rm -rf $OUT/b31
