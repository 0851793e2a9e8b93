"""12-06 call 3: the bf16 MoE gather kernels' prefetching tiles at 26B-A4B shapes, T = 1 / 4 / 16. gate_up: the
evict-first half of GATHER_PREFETCH_GRID without the 1024-wide K (call 1: every best pairing at T = 1 was
evict-first, and 8 / 16 x 1024 on 2 warps ran 10x slower); down: GATHER_DOWN_PREFETCH_GRID (call 1's down
candidates did not compile, a type error fixed since). JSON lines to stdout."""

from perfkit.kernels.moe import GATHER_DOWN_PREFETCH_GRID, GATHER_PREFETCH_GRID, tile_sweep

GATE_UP = tuple(t for t in GATHER_PREFETCH_GRID if t["EVICT_FIRST"] and t["BLOCK_K"] < 1024)

if __name__ == "__main__":
    tile_sweep((1, 4, 16), grid=GATE_UP, down_grid=GATHER_DOWN_PREFETCH_GRID)
