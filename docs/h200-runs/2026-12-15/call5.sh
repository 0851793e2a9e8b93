source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 4, warmup_requests: 1}]'
A='arms=[{name: branches, toggles: {decode_moe_ffn: branches}}]'
for arm in pdl512 plain512 pdl512b plain512b; do
t1=$SECONDS
timeout -s INT 100 python3 -c "import sys, functools, perfkit.runtime.attention.flashinfer as F
if sys.argv[1].startswith('plain512'):
    f = F.paged_decode_attention
    def g(q, *a, **kw):
        if q.shape[-1] == 512: kw['pdl'] = False
        return f(q, *a, **kw)
    F.paged_decode_attention = g
sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/ab_decode_moe_ffn.yaml --set "$A" --set "$S" --set repeats=1 --out $OUT/e_$arm > $OUT/5-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t1))s; grep "│ c1" $OUT/5-$arm.log | cut -c1-140
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_pdl512 e_plain512 e_pdl512b e_plain512b; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-$d.json; rm -rf $OUT/$d; done
rm -f $OUT/5-p*512b.log
python3 -m perfkit compare $OUT/5-e_pdl512.json $OUT/5-e_plain512.json --markdown $OUT/5-compare.md > /dev/null 2>&1
grep -E "TPOT p50|TPOT mean|forward_decode device" $OUT/5-compare.md | head -5
echo total $((SECONDS-t0))s
