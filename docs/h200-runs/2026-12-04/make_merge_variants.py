"""12-04 call 2's merge variants, generated from perfkit/kernels/paged_decode.py at 06e37cf into .carry/ (run from the
repository root): pd_v0_d512 = the committed merge with whole heads per program; pd_v1 = one online pass (lse and
partials of a chunk load together, an empty slice's partial cleared with a where); pd_v1_d512 / pd_v1_s16 = v1 with
whole heads / 16 splits per load. 12-03's merge (paged_decode_old.py) is `git show 63abbd6:perfkit/kernels/paged_decode.py`."""
src = open("perfkit/kernels/paged_decode.py").read()
start = src.index("    b = tl.program_id(0)\n    h = tl.program_id(1)\n    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits\n    sl =")
end = src.index("    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))")
one_pass = '''    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    sl = tl.arange(0, BLOCK_S)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = float("-inf")
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = 0.0
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + sl
        smask = s < num_splits
        lse = tl.load(lse_ptr + base + s, mask=smask, other=float("-inf"))
        part = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
        part = tl.where((lse > float("-inf"))[:, None], part, 0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        scale = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * scale + tl.sum(w[:, None] * part, 0)
        denom = denom * scale + tl.sum(w, 0)
        m = m_new
    o = acc / denom * v_scale
'''
open(".carry/pd_v0_d512.py", "w").write(src.replace("MERGE_BLOCK_D = 128", "MERGE_BLOCK_D = 512"))
v1 = src[:start] + one_pass + src[end:]
open(".carry/pd_v1.py", "w").write(v1)
open(".carry/pd_v1_d512.py", "w").write(v1.replace("MERGE_BLOCK_D = 128", "MERGE_BLOCK_D = 512"))
open(".carry/pd_v1_s16.py", "w").write(v1.replace("MERGE_BLOCK_S = 32", "MERGE_BLOCK_S = 16"))
