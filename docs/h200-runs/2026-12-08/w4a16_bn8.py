"""#10's last W4A16 shape under 60 % of the read ceiling (5376 x 16384 at 59.2-59.9 %, 12-01e): its 336 programs
of 16 rows fill 2.5 of the 3 program slots per SM, so 72 SMs run 3 and 60 run 2. Tiles of 8 rows (672 programs)
should even the load. Times the default and 8-row wide tiles at M = 1 on the three 5376-row 31B shapes.
Run: python3 docs/h200-runs/2026-12-08/w4a16_bn8.py (CUDA); one JSON line per (shape, tile), then the summary."""

from perfkit.kernels import w4a16_gemm as w4

W = dict(block_m=1, num_stages=1, prefetch=2, wide=True)
tiles = [None, w4.GEMV_WIDE_DEEP_CONFIG]
tiles += [w4.W4A16Config(block_n=8, block_k=bk, num_warps=nw, **W) for bk, nw in ((1024, 8), (1024, 4), (512, 4), (512, 2))]
w4.sweep_w4a16(shapes=[(1, 5376, 16384), (1, 5376, 21504), (1, 5376, 8192)], paths=("gemv",), configs=tiles)
