# session 12-02 call 1: ncu of the quantised sorted MoE GEMMs at T=64; W4A16 M>=96 sweep; MoE prefill crossovers
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,driver_version --format=csv,noheader
t0=$SECONDS
timeout 150 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:_moe_gemm_q_kernel --launch-skip 4 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__bytes_read.sum" python3 .carry/p8/moe_one.py > $OUT/1-ncu_moe_q.txt 2>&1; echo ncu rc=$? $((SECONDS-t0))s; grep -E "Duration|Memory Throughput|Compute \(SM\)|Registers|Achieved Occupancy|Theoretical Occupancy|No Eligible|Issued Warp|DRAM Throughput" $OUT/1-ncu_moe_q.txt | head -30
t0=$SECONDS
timeout 200 python3 -c "
import perfkit.kernels.w4a16_gemm as W
W.sweep_w4a16(shapes=[(m, n, k) for m in (96, 128, 256, 512) for n, k in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384))], paths=('dot', 'dequant_mm'))
" > $OUT/1-w4a16_large.jsonl 2> $OUT/1-w4a16.err; echo w4a16 rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-w4a16.err
t0=$SECONDS
timeout 80 python3 -m perfkit.kernels.moe --sweep --quant nvfp4 --tokens 1536,2048,4096 > $OUT/1-moe_nvfp4_cross.jsonl 2> $OUT/1-moe_n.err; echo moe_n rc=$? $((SECONDS-t0))s; tail -2 $OUT/1-moe_n.err
t0=$SECONDS
timeout 100 python3 -m perfkit.kernels.moe --sweep --quant fp8 --tokens 512,1024,2048,8192 > $OUT/1-moe_fp8_cross.jsonl 2> $OUT/1-moe_f.err; echo moe_f rc=$? $((SECONDS-t0))s; tail -2 $OUT/1-moe_f.err
