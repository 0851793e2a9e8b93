source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-17
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_quant.py -k "repack or gemv_tc or pdl_chain" > $OUT/1-tests.log 2>&1
tail -3 $OUT/1-tests.log
timeout -s INT 120 python3 $D/rp_probe.py bench > $OUT/1-bench.jsonl 2> $OUT/1-bench.err
tail -3 $OUT/1-bench.err; cat $OUT/1-bench.jsonl
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__waves_per_multiprocessor,smsp__inst_executed.sum,sm__cycles_active.avg,lts__t_sector_hit_rate.pct,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_wait,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,launch__shared_mem_per_block_dynamic,launch__registers_per_thread
for s in "18432 5376" "16384 5376"; do
  set -- $s
  timeout 100 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:gemv_tc --launch-skip 2 --launch-count 4 --metrics $M \
    python3 $D/rp_probe.py ncu $1 $2 > $OUT/1-ncu_$1x$2.txt 2>&1
  grep -E "gemv_tc|duration|dram__thr|issue_active|warps_active|waves|inst_exec|stalled_long_score.*ratio|stalled_barrier.*ratio" $OUT/1-ncu_$1x$2.txt | head -60
done
