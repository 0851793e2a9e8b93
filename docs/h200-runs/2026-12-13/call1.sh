# session 12-13 call 1: L2 prefetch probe (26B-A4B link); W4A16 gemv M=1 in a chain vs one launch, against the
# stream probe, with candidate wide forms; ncu of the wide kernel at two 31B shapes
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/1-gpu.txt
timeout 150 python3 docs/h200-runs/2026-12-13/prefetch_probe.py > $OUT/1-prefetch.jsonl 2> $OUT/1-prefetch.err
echo prefetch rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-prefetch.err; cat $OUT/1-prefetch.jsonl
timeout 240 python3 docs/h200-runs/2026-12-13/w4a16_probe.py chain > $OUT/1-w4a16_chain.jsonl 2> $OUT/1-w4a16_chain.err
echo chain rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-w4a16_chain.err
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active'
for s in "5376 16384" "43008 5376"; do
  set -- $s
  timeout 90 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:w4a16_gemv --launch-skip 6 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats --metrics "$M" \
    python3 docs/h200-runs/2026-12-13/w4a16_probe.py ncu $1 $2 > $OUT/1-ncu_$1x$2.txt 2>&1
  echo ncu $1x$2 rc=$? $((SECONDS-t0))s
done
grep -E "Duration|DRAM Throughput|Issued Warp|No Eligible|Achieved Occupancy|Registers Per|long_scoreboard|inst_executed" $OUT/1-ncu_*.txt | head -30
