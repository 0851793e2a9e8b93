# the quantised sorted MoE GEMMs at T = 64 (26B-A4B NVFP4): the defaults with byte scales, then a grid with SCALES_VEC
import perfkit.kernels.moe as M

grid = tuple(dict(t) for t in M._DECODE_TILE_GRID) + tuple({**t, "SCALES_VEC": True} for t in M._DECODE_TILE_GRID) + tuple(
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st, "SCALES_VEC": True}
    for n in (32, 64, 128) for k in (64, 128, 256) for w in (4, 8) for st in (2, 4))
M.quant_tile_sweep(tokens=(64,), block_ms=(16,), grid=grid)
