"""The split-KV paged decode kernel (perfkit.kernels.paged_decode) against its reference, its traffic formula and
split rule; on the GPU at real pool shapes, under a CUDA graph with new page tables at replay, and inside the
engine (toggle decode_attention) in lockstep with the torch reference.

CPU: the kernel runs under TRITON_INTERPRET=1 (conftest). Tolerance: the kernel rounds p to bf16 before the p v
dot, as FlashInfer's tensor-core path does, so it is held to 1e-2 x the output scale against the fp32 reference.
"""

import math
import random

import pytest
import torch

from perfkit.kernels.fp8 import FP8_DTYPE
from perfkit.kernels.paged_decode import (
    DecodePrologue,
    new_merge_counter,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_prologue_ref,
    paged_decode_traffic,
    pick_splits,
)
from perfkit.kernels.qk_norm_rope import qk_norm_rope, qkv_norm_rope_split


def make_case(kv_lens, num_heads, kv_heads, head_dim, page_size, dtype=torch.bfloat16, fp8=False, seed=0,
              device="cpu"):  # fmt: skip
    """A cache with pages handed out in random order (page 0 reserved, as the engine's dummy page) and the CSR
    table of rows with the given kv lengths."""
    g = torch.Generator().manual_seed(seed)
    need = sum(math.ceil(n / page_size) for n in kv_lens)
    num_pages = need + 3
    cache = torch.randn(num_pages, 2, page_size, kv_heads, head_dim, generator=g)
    cache = (cache * 40).to(FP8_DTYPE) if fp8 else cache.to(dtype)
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    indices, indptr = [], [0]
    for n in kv_lens:
        k = math.ceil(n / page_size)
        indices += order[:k]
        order = order[k:]
        indptr.append(len(indices))
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=g).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    return (q.to(device), cache.to(device), torch.tensor(indices, **i32), torch.tensor(indptr, **i32),
            torch.tensor(kv_lens, **i32))  # fmt: skip


def assert_close_to_ref(out, ref, tol=1e-2):
    assert torch.isfinite(out.float()).all()
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"max |out - ref| {err:.4g} > {tol} x {scale:.4g}"


CASES = [  # kv_lens, heads, kv heads, head_dim, page size, window, splits
    ([1, 37, 100], 4, 2, 64, 16, None, 1),  # one split writes the output itself
    ([1, 37, 100], 4, 2, 64, 16, None, 4),
    ([5, 200], 16, 2, 128, 16, 40, 3),  # window: keys before kv_len - 40 invisible; group 8
    ([3, 70], 8, 8, 64, 8, 24, 7),  # group 1; more splits than the short row has blocks (empty slices)
    ([47], 4, 1, 64, 64, None, 2),  # page larger than BLOCK_N: one page spans several steps
    ([33, 16, 17], 6, 2, 32, 16, None, 64),  # group 3 (heads padded to 16 rows), 64 splits
    ([300, 2], 4, 2, 256, 16, None, 40),  # two merge column blocks, splits past one merge load, empty slices
    ([40, 9, 33, 17, 64], 16, 2, 256, 16, None, 3),  # 5 x 16 (row, head) pairs: the merge takes whole heads
]


@pytest.mark.parametrize("lens,heads,kvh,hd,ps,window,splits", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference(lens, heads, kvh, hd, ps, window, splits, dtype):
    q, cache, ind, ptr, kl = make_case(lens, heads, kvh, hd, ps, dtype=dtype, seed=len(lens) + splits)
    out = torch.full_like(q, float("nan"))  # every element must be written
    paged_decode_attention(q, cache, ind, ptr, kl, window=window, num_splits=splits, out=out)
    assert_close_to_ref(out, paged_decode_attention_ref(q, cache, ind, ptr, kl, window=window))


@pytest.mark.parametrize("splits", [1, 5])
def test_kernel_fp8_cache_uses_the_scales(splits):
    q, cache, ind, ptr, kl = make_case([9, 61], 8, 2, 64, 16, fp8=True, seed=3)
    kw = dict(window=48, k_scale=0.004, v_scale=0.03)
    out = paged_decode_attention(q, cache, ind, ptr, kl, num_splits=splits, **kw)
    ref = paged_decode_attention_ref(q, cache, ind, ptr, kl, **kw)
    assert_close_to_ref(out, ref)
    unscaled = paged_decode_attention_ref(q, cache, ind, ptr, kl, window=48)
    assert (ref.float() - unscaled.float()).abs().max() > 0.1  # the scales matter at these values


def test_splits_agree_with_each_other_and_ignore_pages_outside_the_table():
    """The same rows with 1, 2, 9 and 33 splits; then every page not in the table overwritten with garbage."""
    q, cache, ind, ptr, kl = make_case([130, 7, 64], 8, 4, 64, 16, seed=5)
    outs = [paged_decode_attention(q, cache, ind, ptr, kl, num_splits=s) for s in (1, 2, 9, 33)]
    for o in outs[1:]:
        assert_close_to_ref(o, outs[0], tol=4e-3)
    unused = sorted(set(range(cache.shape[0])) - set(ind.tolist()))
    cache[unused] = 1e4
    again = paged_decode_attention(q, cache, ind, ptr, kl, num_splits=9)
    assert torch.equal(again, outs[2])


@pytest.mark.parametrize("fused", [False, True])
def test_merge_drops_the_partials_of_empty_slices(monkeypatch, fused):
    """Empty slices write only their lse (-inf); their partials stay as allocated. Allocated as NaN here, the
    output must still be finite and equal the reference, with the merge launch and with the fused merge."""
    import perfkit.kernels.paged_decode as pd

    real = pd._split_buffers
    monkeypatch.setattr(pd, "_split_buffers", lambda *a: tuple(t.fill_(float("nan")) for t in real(*a)))
    q, cache, ind, ptr, kl = make_case([3, 70, 1], 8, 2, 64, 16, seed=11)  # rows of 3 and 1 keys: 1 live slice, 15 empty
    counter = new_merge_counter(3, 2, "cpu") if fused else None
    out = paged_decode_attention(q, cache, ind, ptr, kl, num_splits=16, merge_counter=counter)
    assert torch.isfinite(out.float()).all()
    assert_close_to_ref(out, paged_decode_attention_ref(q, cache, ind, ptr, kl))


FUSED_CASES = [  # kv_lens, heads, kv heads, head_dim, page size, window, splits: all within FUSED_MERGE_MAX_ELEMENTS
    ([1, 37, 100], 4, 2, 64, 16, None, 4),
    ([3, 70], 8, 8, 64, 8, 24, 7),  # group 1, empty slices
    ([33, 16, 17], 6, 2, 32, 16, None, 64),  # group 3, 64 splits: two chunks of 32 (the online rescale)
    ([300, 2], 4, 2, 256, 16, None, 32),  # the 26B-A4B sliding merge's size (2 x 32 x 256); empty slices
]


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the merge launch ran")


@pytest.mark.parametrize("lens,heads,kvh,hd,ps,window,splits", FUSED_CASES)
def test_fused_merge_is_the_merge_launch_in_one_kernel(monkeypatch, lens, heads, kvh, hd, ps, window, splits):
    """With a counter the last slice of each (row, kv head) merges: no merge launch, the merge launch's output bit
    for bit (the same tiles and sums), the counters back at zero, and the same again on a second launch with them."""
    import perfkit.kernels.paged_decode as pd

    assert pd.fused_merge_fits(heads // kvh, splits, hd)
    q, cache, ind, ptr, kl = make_case(lens, heads, kvh, hd, ps, seed=len(lens) + splits)
    ref = paged_decode_attention_ref(q, cache, ind, ptr, kl, window=window)
    sep = paged_decode_attention(q, cache, ind, ptr, kl, window=window, num_splits=splits)
    counter = new_merge_counter(len(lens), kvh, "cpu")
    monkeypatch.setattr(pd, "_merge_splits_kernel", _NoLaunch())
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, cache, ind, ptr, kl, window=window, num_splits=splits, out=out,
                               merge_counter=counter)  # fmt: skip
        assert not counter.any()
        assert_close_to_ref(out, ref)
        assert torch.equal(out, sep)


def test_fused_merge_only_where_it_fits_and_checks_its_counter():
    from perfkit.kernels.paged_decode import fused_merge_fits

    assert fused_merge_fits(2, 32, 256) and fused_merge_fits(2, 17, 256)  # 26B-A4B / 31B sliding at batch 1
    assert not fused_merge_fits(8, 64, 512)  # the hd 512 full pools keep the merge launch
    assert not fused_merge_fits(2, 1, 256)  # one split writes the output itself
    q, cache, ind, ptr, kl = make_case([40, 50], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="merge_counter"):
        paged_decode_attention(q, cache, ind, ptr, kl, num_splits=2, merge_counter=new_merge_counter(1, 2, "cpu"))
    big = make_case([40], 16, 2, 512, 16)
    out = paged_decode_attention(*big, num_splits=64, merge_counter=new_merge_counter(1, 2, "cpu"))  # launch merge
    assert_close_to_ref(out, paged_decode_attention_ref(*big))


def test_kernel_rejects_mismatched_inputs():
    q, cache, ind, ptr, kl = make_case([4], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q[:, :3], cache, ind, ptr, kl)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        paged_decode_attention(q.float(), cache.float(), ind, ptr, kl)
    with pytest.raises(ValueError, match="neither"):
        paged_decode_attention(q, cache.half(), ind, ptr, kl)


def test_pick_splits_fills_the_machine_within_the_span():
    assert pick_splits(1, 16, 132, 1024) == 17  # 264 programs wanted, 1024 / 32 = 32 blocks available
    assert pick_splits(1, 2, 132, None) == 64  # capped by max_splits
    assert pick_splits(1, 8, 132, 64, block_n=32) == 2  # a 64-token window has 2 blocks
    assert pick_splits(64, 16, 132, 1024) == 1  # enough programs already
    assert pick_splits(4, 16, 132, 1024) == 9  # a sliding pool from batch 2: 4 programs per SM
    assert pick_splits(4, 16, 132, 1024, programs_per_sm=2) == 5
    assert pick_splits(4, 4, 132, None) == 17  # full pools keep 2 per SM
    assert pick_splits(0, 4, 1, None) >= 1


def test_traffic_counts_the_visible_keys_once():
    t = paged_decode_traffic([10, 3000], num_heads=32, num_kv_heads=16, head_dim=256, window=1024)
    visible = 10 + 1024
    assert t["kv_bytes"] == 2 * visible * 16 * 256 * 2
    assert t["min_bytes"] == t["kv_bytes"] + 2 * 2 * 32 * 256 * 2
    assert t["flops"] == 4 * visible * 32 * 256
    s = paged_decode_traffic([10], 8, 2, 64, num_splits=4, kv_bytes=1)  # one 32-row slice holds all 10 keys
    # lse written and read per split, the one live partial written, every split's partial read by the merge
    assert s["split_bytes"] == 8 * (2 * 4 + (1 + 4) * 64) * 4 and s["total_bytes"] == s["min_bytes"] + s["split_bytes"]
    f = paged_decode_traffic([1024], 32, 4, 512, num_splits=64)  # 31B full pool at batch 1: 32 live slices of 32
    assert f["split_bytes"] == 32 * (2 * 64 + (32 + 64) * 512) * 4


def prologue_case(lens, heads, kvh, hd, ps, kind="kv", fp8=False, dtype=torch.bfloat16, seed=0, device="cpu"):
    """`make_case` plus one step's raw projections (views of one merged qkv row, as the model passes them), norm
    weights, RoPE tables at each row's newest position and the slots of that position in the row's pages.
    kind: "kv" (k and v projections), "k=v" (no v projection) or "q" (a KV-shared layer: q only)."""
    _, cache, ind, ptr, kl = make_case(lens, heads, kvh, hd, ps, dtype=dtype, fp8=fp8, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    B = len(lens)
    width = (heads + kvh * (1 if kind == "k=v" else 2)) * hd
    qkv = (torch.randn(B, width, generator=g) * 3).to(dtype).to(device)
    q_raw = qkv[:, : heads * hd].view(B, heads, hd)
    k_raw = qkv[:, heads * hd : (heads + kvh) * hd].view(B, kvh, hd)
    v_raw = None if kind == "k=v" else qkv[:, (heads + kvh) * hd :].view(B, kvh, hd)
    inv_freq = 1.0 / (10000 ** (torch.arange(hd // 2).float() / (hd // 2)))
    ang = torch.tensor([n - 1.0 for n in lens])[:, None] * inv_freq[None]
    pages = [int(ind[ptr[b] + (n - 1) // ps]) for b, n in enumerate(lens)]
    slots = [torch.tensor(x, device=device) for x in (pages, [(n - 1) % ps for n in lens])]
    w = [(torch.randn(hd, generator=g) * 0.5 + 1).to(dtype).to(device) for _ in range(2)]
    pro = DecodePrologue(w[0], ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device), 1e-6,
                         None if kind == "q" else k_raw, v_raw, w[1], *slots)  # fmt: skip
    return q_raw, cache, ind, ptr, kl, pro


def separate_path(q_raw, cache, ind, ptr, kl, pro, **kw):
    """What the prologue replaces: the qkv_norm_rope launch (q; the new K / V rows into `cache`), then the kernel."""
    if pro.k_raw is None:
        q = qk_norm_rope(q_raw, pro.q_weight, pro.cos, pro.sin, pro.eps)
    else:
        target = (cache, pro.slot_page, pro.slot_offset, kw.get("k_scale", 1.0), kw.get("v_scale", 1.0))
        q = qkv_norm_rope_split(q_raw, pro.k_raw, pro.v_raw, pro.q_weight, pro.k_weight, pro.cos, pro.sin, pro.eps,
                                target)[0]  # fmt: skip
    return paged_decode_attention(q, cache, ind, ptr, kl, **kw)


PROLOGUE_CASES = [  # kv_lens, heads, kv heads, head_dim, page size, window, splits, kind, fp8
    ([1, 37, 100], 4, 2, 64, 16, None, 1, "kv", False),  # one split: the direct store; a row of one key
    ([1, 37, 100], 4, 2, 64, 16, None, 4, "kv", False),  # the newest row in the last live slice only
    ([5, 200], 16, 2, 128, 16, 40, 3, "kv", True),  # fp8 cache: the new row quantised as write_kv
    ([3, 70], 8, 8, 64, 8, 24, 7, "k=v", False),  # K=V: v = v_norm(k_raw); empty slices
    ([33, 16, 17], 6, 2, 32, 16, None, 64, "q", False),  # KV-shared layer: q only, the newest row read
    ([47, 32], 4, 1, 64, 64, None, 2, "k=v", True),  # a page spanning several BLOCK_N steps; K=V fp8
]


@pytest.mark.parametrize("lens,heads,kvh,hd,ps,window,splits,kind,fp8", PROLOGUE_CASES)
def test_prologue_is_the_separate_path_bit_for_bit(lens, heads, kvh, hd, ps, window, splits, kind, fp8):
    """The kernel with the q/k norm + RoPE prologue against the qkv_norm_rope launch + the kernel: equal outputs and
    equal cache bytes, with the new rows' slots holding NaN before the fused launch (so it must not read them: the
    newest row comes from registers). And both near the fp32 references (which round q, k to bf16 between the norm
    and RoPE, as the unfused model does, hence the looser tolerance)."""
    q_raw, cache, ind, ptr, kl, pro = prologue_case(lens, heads, kvh, hd, ps, kind, fp8, seed=len(lens) + splits)
    kw = dict(window=window, k_scale=0.02 if fp8 else 1.0, v_scale=0.03 if fp8 else 1.0)
    sep_cache, ref_cache = cache.clone(), cache.clone()
    sep = separate_path(q_raw, sep_cache, ind, ptr, kl, pro, num_splits=splits, **kw)
    if kind != "q":
        nan = torch.tensor(float("nan"), dtype=torch.float32).to(cache.dtype)
        cache[:, :][pro.slot_page, :, pro.slot_offset] = nan  # K and V planes of every new row
    out = torch.full_like(sep, float("nan"))
    paged_decode_attention(q_raw, cache, ind, ptr, kl, num_splits=splits, out=out, prologue=pro, **kw)
    assert torch.equal(out, sep)
    assert torch.equal(cache.view(torch.uint8), sep_cache.view(torch.uint8))
    ref = paged_decode_prologue_ref(q_raw, ref_cache, ind, ptr, kl, pro, **kw)
    assert_close_to_ref(out, ref, tol=5e-2)


_SM90_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from perfkit.kernels import paged_decode as pd

ptrs = ("q_ptr", "cache_ptr", "out_ptr", "k_raw_ptr", "v_raw_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr")
sig = dict.fromkeys(ptrs, "*bf16") | dict.fromkeys(("indices_ptr", "indptr_ptr", "kv_lens_ptr"), "*i32")
sig |= dict.fromkeys(("part_ptr", "lse_ptr"), "*fp32") | dict.fromkeys(("slot_page_ptr", "slot_offset_ptr"), "*i64")
sig |= {"count_ptr": "*i32"}
sig |= dict.fromkeys(("stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_page", "stride_kv", "stride_tok",
                      "stride_head", "num_splits", "window", "stride_kb", "stride_kh", "stride_vb", "stride_vh",
                      "stride_cb", "stride_sb"), "i32")
sig |= dict.fromkeys(("qk_scale", "v_scale", "eps", "k_inv_scale", "v_inv_scale"), "fp32")
rows = []
for hd, group, fp8, direct, prologue, new_kv, fuse in json.loads(sys.argv[1]):
    consts = {"GROUP": group, "BLOCK_H": 16, "HEAD_DIM": hd, "PAGE_SIZE": 16, "BLOCK_N": 32, "FP8": fp8,
              "DIRECT": direct, "UPCAST": 0, "PDL": 1, "PROLOGUE": prologue, "NEW_KV": new_kv, "FUSE_MERGE": fuse,
              "MERGE_S": 32, "MERGE_CHUNKS": 1, "MERGE_D": 128}
    s = sig | {"cache_ptr": "*u8" if fp8 else "*bf16"} | dict.fromkeys(consts, "constexpr")
    try:
        k = triton.compile(ASTSource(pd._paged_decode_kernel, s, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 2})
        regs, stack = resource_usage(k)
        ok = "griddepcontrol.wait" in k.asm["ptx"]
        ok = ok and (not fuse or "atom.global.gpu.acq_rel.add" in k.asm["ptx"]) and (prologue or stack == 0)
        rows.append(ok or f"regs {regs} stack {stack}")
    except Exception as exc:
        rows.append(f"{type(exc).__name__}: {exc}"[:2000])
print(json.dumps(rows))
"""


def test_decode_variants_compile_for_sm90():
    """Ahead-of-time compile for sm_90 (no GPU needed; outside the interpreter, which accepted a prologue helper
    whose two constexpr paths returned different dtypes, where the compiler refuses it): the plain kernel and the
    prologue's variants (q only, new K / V rows, fp8 cache) at the engine's pool shapes, and the fused merge's at
    the sliding pools' (the counter's acquire-release atomic). No spills without the prologue (which spills with or
    without the merge): the plain kernel takes 235 registers, 243 with the fused merge (Triton 3.9), two programs
    per SM at 4 warps either way."""
    import json

    from aot import sm90_rows

    variants = [(256, 2, 0, 0, 0, 0, 0), (256, 2, 0, 0, 1, 1, 0), (512, 8, 1, 0, 1, 1, 0), (256, 2, 1, 1, 1, 1, 0),
                (512, 8, 0, 1, 1, 0, 0), (256, 2, 0, 0, 0, 0, 1), (256, 2, 1, 0, 0, 0, 1), (256, 2, 1, 0, 1, 1, 1)]  # fmt: skip
    rows = sm90_rows(_SM90_COMPILE, json.dumps(variants))
    assert rows == [True] * len(variants), rows


def test_prologue_rejects_mismatched_inputs():
    q_raw, cache, ind, ptr, kl, pro = prologue_case([4, 9], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="cos / sin"):
        paged_decode_attention(q_raw, cache, ind, ptr, kl, prologue=pro._replace(cos=pro.cos[:1]))
    with pytest.raises(ValueError, match="k_raw must be"):
        paged_decode_attention(q_raw, cache, ind, ptr, kl, prologue=pro._replace(k_raw=pro.k_raw[:, :1]))
    with pytest.raises(ValueError, match="needs k_weight"):
        paged_decode_attention(q_raw, cache, ind, ptr, kl, prologue=pro._replace(slot_page=None))
    with pytest.raises(ValueError, match="slot_page"):
        paged_decode_attention(q_raw, cache, ind, ptr, kl, prologue=pro._replace(slot_offset=pro.slot_offset[:1]))


def test_prologue_traffic_moves_the_new_rows_once():
    base = paged_decode_traffic([100, 7], 8, 2, 64)
    q = paged_decode_traffic([100, 7], 8, 2, 64, prologue="q")
    kv = paged_decode_traffic([100, 7], 8, 2, 64, prologue="kv")
    kev = paged_decode_traffic([100, 7], 8, 2, 64, prologue="k=v", kv_bytes=1)
    assert q["prologue_bytes"] == 64 * 2 + 2 * 64 * 2 and q["saved_bytes"] == 2 * 2 * 8 * 64 * 2
    assert q["total_bytes"] == base["total_bytes"] + q["prologue_bytes"] and base["prologue_bytes"] == 0
    rows = 2 * 2 * 64  # B x kvh x D
    assert kv["prologue_bytes"] == q["prologue_bytes"] + 2 * rows * 2 + 64 * 2 + 16 * 2
    assert kv["saved_bytes"] == q["saved_bytes"] + 2 * rows * 2
    assert kev["prologue_bytes"] == q["prologue_bytes"] + rows * 2 + 64 * 2 + 16 * 2
    assert kev["saved_bytes"] == q["saved_bytes"] + 2 * rows * 1
    with pytest.raises(ValueError, match="prologue"):
        paged_decode_traffic([1], 8, 2, 64, prologue="k")


def test_backend_attend_raw_folds_only_decode_only_triton_steps():
    """FlashInferBackend.attend_raw (needs no flashinfer itself) on a stand-in backend: a decode-only step on a
    Triton plan gives the separate path's output and cache bytes; the toggle off, a prefill row in the step or
    FlashInfer's decode give None (the model then launches qkv_norm_rope)."""
    import types

    import perfkit.runtime.attention.flashinfer as F
    from perfkit.runtime.attention.base import AttnLayer

    lens = [20, 45, 3]
    q_raw, cache, ind, ptr, kl, pro = prologue_case(lens, 8, 2, 64, 16, seed=4)
    sep_cache = cache.clone()
    sep = separate_path(q_raw, sep_cache, ind, ptr, kl, pro, window=32, num_splits=3)
    layer = AttnLayer(index=0, is_sliding=True, head_dim=64, num_heads=8, num_kv_heads=2, window=32, cache_layer=0,
                      writes_kv=True, bidirectional_vision=False)  # fmt: skip
    pt = types.SimpleNamespace(slot_page=pro.slot_page, slot_offset=pro.slot_offset)
    kv = types.SimpleNamespace(pool_of=lambda i: "sliding", layer_cache=lambda i: cache,
                               layer_scales=lambda i: (1.0, 1.0), is_fp8=False)  # fmt: skip
    plan = F.TritonDecodePlan(ind, ptr, kl, 3, 32)

    def attend_raw(on=True, batch=3, dec=plan):
        meta = types.SimpleNamespace(num_decodes=3, batch_size=batch, pools={"sliding": pt})
        backend = types.SimpleNamespace(decode_prologue=on, meta=meta, q_dtype=torch.bfloat16, kv=kv, pdl=False,
                                        _active={"sliding": (dec, None)}, _merge_counter=lambda: None)  # fmt: skip
        return F.FlashInferBackend.attend_raw(backend, layer, q_raw, pro.k_raw, pro.v_raw, pro.q_weight,
                                              pro.k_weight, pro.cos, pro.sin, pro.eps)  # fmt: skip

    assert attend_raw(on=False) is None and attend_raw(batch=4) is None and attend_raw(dec=object()) is None
    assert not torch.equal(cache, sep_cache)  # the None cases wrote nothing
    assert torch.equal(attend_raw(), sep)
    assert torch.equal(cache, sep_cache)


def test_backend_triton_plan_stages_aligned_lengths_without_growing(monkeypatch):
    """The FlashInfer backend's Triton decode plan (needs no flashinfer itself): for every decode batch up to the
    engine's maximum, eager and graph plans hand the kernel the step's indptr and kv lengths, both 16-byte aligned,
    from a staging buffer that never grows (a graph captures its address)."""
    import types

    import numpy as np

    import perfkit.runtime.attention.flashinfer as F
    from perfkit.runtime.page_table import PinnedStaging, PoolTable

    monkeypatch.setattr(F, "sm_count", lambda device: 132)
    max_batch, cpu = 8, torch.device("cpu")
    stage = PinnedStaging(2 * max_batch + 4, torch.int32, cpu)  # the backend's size
    backend = types.SimpleNamespace(
        kv=types.SimpleNamespace(specs={"sliding": types.SimpleNamespace(num_kv_heads=16, window=1024)}),
        device=cpu, _tri_meta={"sliding": stage}, _tri_indices={"sliding": torch.zeros(64, dtype=torch.int32)},
    )  # fmt: skip
    dev_before = stage.dev
    for nd in range(1, max_batch + 1):
        indptr = np.concatenate([[0], np.cumsum(np.arange(1, nd + 1))]).astype(np.int32)
        pt = PoolTable(indptr=torch.from_numpy(indptr), indices=torch.arange(int(indptr[-1]), dtype=torch.int32),
                       last_page_len=torch.ones(nd, dtype=torch.int32), kv_lens=torch.arange(nd, dtype=torch.int32) + 50,
                       slot_page=torch.zeros(nd, dtype=torch.long), slot_offset=torch.zeros(nd, dtype=torch.long))  # fmt: skip
        for graph in (False, True):
            plan = F.FlashInferBackend._triton_decode_plan(backend, "sliding", pt, nd, graph)
            assert torch.equal(plan.indptr, pt.indptr) and torch.equal(plan.kv_lens, pt.kv_lens)
            assert plan.indptr.data_ptr() % 16 == 0 and plan.kv_lens.data_ptr() % 16 == 0
            assert torch.equal(plan.indices[: int(indptr[-1])], pt.indices)
    assert stage.dev is dev_before


def test_toggle_values_and_auto_rule():
    from perfkit.config import TOGGLES, Toggles
    from perfkit.runtime.attention.flashinfer import TRITON_DECODE_MAX_BATCH, use_triton_decode
    from perfkit.runtime.engine import TOGGLES as ENGINE_TOGGLES

    assert ENGINE_TOGGLES["decode_attention"] == TOGGLES["decode_attention"][0]
    assert Toggles().decode_attention == TOGGLES["decode_attention"][1]
    assert use_triton_decode("triton", 256) and not use_triton_decode("flashinfer", 1)
    assert use_triton_decode("auto", TRITON_DECODE_MAX_BATCH) and not use_triton_decode("auto", TRITON_DECODE_MAX_BATCH + 1)
    with pytest.raises(ValueError, match="decode_attention"):
        use_triton_decode("fast", 1)


# ---- GPU -----------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REAL = {  # pool: heads, kv heads, head_dim, window
    "31b-sliding": (32, 16, 256, 1024),
    "31b-full": (32, 4, 512, None),
    "26b-sliding": (16, 8, 256, 1024),
    "26b-full": (16, 2, 512, None),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool", list(REAL))
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_real_shapes_match_reference(pool, fp8):
    heads, kvh, hd, window = REAL[pool]
    rng = random.Random(hd + kvh)
    for bs in (1, 3, 16):
        lens = [rng.randint(1, 2100) for _ in range(bs)]
        q, cache, ind, ptr, kl = make_case(lens, heads, kvh, hd, 16, fp8=fp8, seed=bs, device="cuda")
        kw = dict(window=window, k_scale=0.01 if fp8 else 1.0, v_scale=0.02 if fp8 else 1.0)
        ref = paged_decode_attention_ref(q, cache, ind, ptr, kl, **kw)
        for splits in (1, pick_splits(bs, kvh, 132, window)):
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(q, cache, ind, ptr, kl, num_splits=splits, out=out, **kw)
            assert_close_to_ref(out, ref)
            counter = new_merge_counter(bs, kvh, "cuda")  # the fused merge where it fits: the same sums (bf16
            # caches bit for bit; with fp8 ones the fused variant's compile of the slices differs by an ulp at times)
            fused = paged_decode_attention(q, cache, ind, ptr, kl, num_splits=splits, merge_counter=counter, **kw)
            assert (torch.equal(fused, out) or fp8) and not counter.any()
            assert_close_to_ref(fused, out, tol=4e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_graph_replay_reads_the_new_page_table(fused):
    """Capture once, then change the table's contents (lengths, pages) in place: the replay computes the new rows
    (fused: the merge in the decode launch, its counters back at zero after every replay)."""
    heads, kvh, hd, window = REAL["31b-sliding"]
    q, cache, ind, ptr, kl = make_case([700, 1500], heads, kvh, hd, 16, seed=1, device="cuda")
    ind_buf = torch.zeros(400, dtype=torch.int32, device="cuda")
    ind_buf[: len(ind)] = ind
    out = torch.empty_like(q)
    splits = pick_splits(2, kvh, 132, window)
    counter = new_merge_counter(2, kvh, "cuda") if fused else None

    def run():
        paged_decode_attention(q, cache, ind_buf, ptr, kl, window=window, num_splits=splits, out=out,
                               merge_counter=counter)  # fmt: skip

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    kl.copy_(torch.tensor([650, 30], dtype=torch.int32))  # within each row's pages (44 and 94)
    perm = torch.randperm(len(ind), device="cuda")
    ind_buf[: len(ind)] = ind[perm]
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    assert_close_to_ref(out, paged_decode_attention_ref(q, cache, ind_buf[: len(ind)], ptr, kl, window=window))
    assert counter is None or not counter.any()


def _lockstep_triton(name, graphs, bs, **kw):
    pytest.importorskip("flashinfer")
    from test_engine_gpu import engine, fp32_twin, lockstep, model_for, prompts

    cfg, model = model_for(name)
    reqs = [(p, {}) for p in prompts(bs, seed=bs + 100, vocab=cfg.vocab_size, long_every=8)]
    cand = engine(model, cfg, "flashinfer", graphs, decode_attention="triton", **kw)
    st = lockstep(engine(fp32_twin(name), cfg, "torch", False), engine(model, cfg, "torch", False, **kw), cand,
                  reqs, 24)  # fmt: skip
    if graphs:
        assert st["graph_steps"] > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("name,bs", [("tiny-fi", 1), ("tiny-fi", 17), ("31b", 1), ("31b", 4), ("31b", 64)])
def test_gpu_engine_triton_decode_matches_torch(name, bs, graphs):
    """decode_attention=triton inside the engine: FlashInfer prefill, the Triton kernel on every decode row (mixed
    steps eagerly, pure decodes from graphs), long prompts past the 1024 window (trimmed sliding pages)."""
    _lockstep_triton(name, graphs, bs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_engine_triton_decode_fp8_kv(graphs):
    _lockstep_triton("31b", graphs, 9, kv_dtype="fp8")


@pytest.mark.gpu
@needs_cuda
def test_gpu_toggle_switches_the_captured_graphs():
    """decode_attention switched on a live engine captures the graphs again with the other kernel; auto at 6 rows
    runs the Triton kernel, so its tokens equal triton's bit for bit (flashinfer's are checked by the lockstep)."""
    pytest.importorskip("flashinfer")
    from test_engine_gpu import engine, model_for, prompts

    cfg, model = model_for("31b")
    outs = {}
    for kernel in ("flashinfer", "triton", "auto"):
        e = engine(model, cfg, "flashinfer", True)
        e.set_toggle("decode_attention", kernel)
        assert e.toggles()["decode_attention"] == kernel
        assert e.runner.backend.decode_kernel == kernel and e._graphs is not None
        rids = [e.add_request(p, max_new_tokens=12) for p in prompts(6, seed=9, vocab=cfg.vocab_size)]
        got = e.generate_all()
        outs[kernel] = [got[r] for r in rids]
        e.bm.check_no_leaks()
    assert outs["auto"] == outs["triton"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool,kind", [("31b-sliding", "kv"), ("31b-full", "k=v"), ("26b-sliding", "kv"),
                                       ("26b-full", "k=v"), ("31b-sliding", "q")])  # fmt: skip
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_prologue_matches_the_separate_path(pool, kind, fp8):
    """Real pool shapes, batch 1 / 3 / 16, the engine's split counts: the prologue against the qkv_norm_rope launch
    + the kernel. The compiler may contract the two RoPE products differently in the two kernels (an fp32 ulp), so
    a q / k element may round to the neighbouring bf16 (or e4m3) value: the outputs are held to the kernel's own
    tolerance against each other, the cache bytes to a few differing codes, and the counts are printed."""
    heads, kvh, hd, window = REAL[pool]
    rng = random.Random(hd + kvh)
    for bs in (1, 3, 16):
        lens = [rng.randint(1, 2100) for _ in range(bs)]
        q_raw, cache, ind, ptr, kl, pro = prologue_case(lens, heads, kvh, hd, 16, kind, fp8, seed=bs, device="cuda")
        kw = dict(window=window, k_scale=0.02 if fp8 else 1.0, v_scale=0.03 if fp8 else 1.0,
                  num_splits=pick_splits(bs, kvh, 132, window))  # fmt: skip
        sep_cache = cache.clone()
        sep = separate_path(q_raw, sep_cache, ind, ptr, kl, pro, **kw)
        out = paged_decode_attention(q_raw, cache, ind, ptr, kl, prologue=pro, **kw)
        bytes_off = (cache.view(torch.uint8) != sep_cache.view(torch.uint8)).sum().item()
        print(pool, kind, fp8, bs, "max |out - sep|", (out.float() - sep.float()).abs().max().item(),
              "cache bytes off", bytes_off)  # fmt: skip
        assert_close_to_ref(out, sep)  # a q element one bf16 ulp off moves an fp8 31B full output by 3e-3 x scale
        assert bytes_off <= 2 * bs * kvh * hd // 100  # at most 1 % of the new rows' bytes


@pytest.mark.gpu
@needs_cuda
def test_gpu_prologue_graph_replay_uses_the_new_slots_and_tables():
    """A captured prologue launch replayed after the raw projections, tables, lengths and slots change in place:
    the replay writes the new rows where the new slots point and equals the separate path on the new inputs."""
    heads, kvh, hd, window = REAL["31b-sliding"]
    q_raw, cache, ind, ptr, kl, pro = prologue_case([700, 1500], heads, kvh, hd, 16, seed=2, device="cuda")
    kw = dict(window=window, num_splits=pick_splits(2, kvh, 132, window))
    out = torch.empty(2, heads, hd, dtype=q_raw.dtype, device="cuda")

    def run():
        paged_decode_attention(q_raw, cache, ind, ptr, kl, out=out, prologue=pro, **kw)

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    kl.copy_(torch.tensor([650, 30], dtype=torch.int32))  # within each row's pages
    pro.slot_page.copy_(torch.stack([ind[ptr[0] + 649 // 16], ind[ptr[1] + 29 // 16]]).long())
    pro.slot_offset.copy_(torch.tensor([649 % 16, 29 % 16]))
    q_raw.copy_(torch.randn_like(q_raw.float()).to(q_raw.dtype))
    sep_cache = cache.clone()
    g.replay()
    torch.cuda.synchronize()
    sep = separate_path(q_raw, sep_cache, ind, ptr, kl, pro, **kw)
    assert_close_to_ref(out, sep)
    assert (cache.view(torch.uint8) != sep_cache.view(torch.uint8)).sum().item() <= 2 * kvh * hd // 50


def _toggle_arm_tokens(preset, arms, toggle, live_value, seed, max_prompt, max_num_tokens, after=None, **kw):
    """Greedy tokens of a 2-layer real-width engine (FlashInfer + CUDA graphs + the fused kernels, the Triton decode at
    every decode-only step with max_batch_size 8, padded graph rows included, PDL where available, staggered lengths)
    for each EngineConfig arm in ``arms``, then for a live engine with ``toggle`` switched to ``live_value`` (its
    graphs captured again). ``after(engine)``: a check after each engine's requests."""
    pytest.importorskip("flashinfer")
    from perfkit.kernels.pdl import pdl_available
    from perfkit.runtime.engine import Engine, EngineConfig
    from perfkit.runtime.model_config import get_preset
    from perfkit.runtime.weights import build_model

    cfg = get_preset(preset, num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    rng = random.Random(seed)
    reqs = [[rng.randint(3, min(cfg.vocab_size, 250_000) - 1) for _ in range(rng.randint(1, max_prompt))]
            for _ in range(12)]  # fmt: skip
    kw = dict(attention="flashinfer", cuda_graphs=True, page_size=16, max_batch_size=8, max_num_tokens=max_num_tokens,
              num_kv_pages=2000, max_model_len=1024, mask="triton", fused_kernels=True, decode_attention="triton",
              pdl=pdl_available(torch.device("cuda")), **kw)  # fmt: skip

    def run(e):
        rids = [e.add_request(p, max_new_tokens=8 + (i % 5) * 6) for i, p in enumerate(reqs)]
        got = e.generate_all()
        e.bm.check_no_leaks()
        if after is not None:
            after(e)
        return [got[r] for r in rids]

    outs = [run(Engine(model, cfg, EngineConfig(**kw, **arm))) for arm in arms]
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle(toggle, live_value)
    assert live.toggles()[toggle] == live_value
    return outs + [run(live)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("preset,kv_dtype", [("31b", "auto"), ("31b", "fp8"), ("26b-a4b", "auto")])
def test_gpu_engine_tokens_identical_with_decode_prologue(preset, kv_dtype):
    """decode_prologue fused gives the separate arm's tokens (mixed steps keep the separate launch), and so does
    switching it on a live engine (`_toggle_arm_tokens`)."""
    arms = [{"decode_prologue": f} for f in (False, True)]
    outs = _toggle_arm_tokens(preset, arms, "decode_prologue", "fused", 31, 200, 512, kv_dtype=kv_dtype)
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("preset", ["31b", "26b-a4b"])
def test_gpu_engine_tokens_identical_with_decode_merge(preset):
    """decode_merge fused (the sliding layers' slices merged in the decode launch) gives the launch arm's tokens,
    also switched on a live engine, its counters back at zero after every engine (`_toggle_arm_tokens`)."""

    def counters_zero(e):
        assert not e.runner.backend._merge_count.any()

    arms = [{"decode_merge": m} for m in ("launch", "fused")]
    outs = _toggle_arm_tokens(preset, arms, "decode_merge", "fused", 7, 900, 1024, after=counters_zero)
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_decode_prologue_kv_shared_layers_lockstep():
    """tiny-e4b at the real head dims (its last 4 layers KV-shared: the prologue makes q only and reads the newest
    row written by the owner layer earlier in the step) with decode_prologue fused, in lockstep against the float32
    torch reference beside the separate arm (a random tiny model turns one bf16 ulp into other tokens, so tokens
    alone would not do: teacher-forced logits within the separate arm's error bound)."""
    pytest.importorskip("flashinfer")
    import copy

    from test_engine_gpu import engine, lockstep, prompts

    from perfkit.runtime.model_config import get_preset
    from perfkit.runtime.weights import build_model

    cfg = get_preset("tiny-e4b").replace(name="tiny-e4b-fi", head_dim=256, global_head_dim=512, sliding_window=16)
    assert cfg.num_kv_shared_layers
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    twin = copy.deepcopy(model).float()
    reqs = [(p, {}) for p in prompts(6, seed=5, vocab=cfg.vocab_size)]
    kw = dict(fused_kernels=True, decode_attention="triton", max_batch_size=8)
    base = engine(copy.deepcopy(model), cfg, "flashinfer", True, **kw)
    cand = engine(copy.deepcopy(model), cfg, "flashinfer", True, decode_prologue=True, **kw)
    st = lockstep(engine(twin, cfg, "torch", False), base, cand, reqs, 24)
    assert st["graph_steps"] > 0
