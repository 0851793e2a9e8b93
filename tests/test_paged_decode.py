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
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_traffic,
    pick_splits,
)


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


def test_merge_never_reads_an_empty_slice(monkeypatch):
    """Empty slices write only their lse (-inf); their partials stay as allocated. Allocated as NaN here, the
    output must still be finite and equal the reference."""
    import perfkit.kernels.paged_decode as pd

    real = pd._split_buffers
    monkeypatch.setattr(pd, "_split_buffers", lambda *a: tuple(t.fill_(float("nan")) for t in real(*a)))
    q, cache, ind, ptr, kl = make_case([3, 70, 1], 8, 2, 64, 16, seed=11)  # rows of 3 and 1 keys: 1 live slice, 15 empty
    out = paged_decode_attention(q, cache, ind, ptr, kl, num_splits=16)
    assert torch.isfinite(out.float()).all()
    assert_close_to_ref(out, paged_decode_attention_ref(q, cache, ind, ptr, kl))


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
    assert s["split_bytes"] == 2 * 8 * (4 + 1 * 64) * 4 and s["total_bytes"] == s["min_bytes"] + s["split_bytes"]
    f = paged_decode_traffic([1024], 32, 4, 512, num_splits=64)  # 31B full pool at batch 1: 32 live slices of 32
    assert f["split_bytes"] == 2 * 32 * (64 + 32 * 512) * 4


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


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_reads_the_new_page_table():
    """Capture once, then change the table's contents (lengths, pages) in place: the replay computes the new rows."""
    heads, kvh, hd, window = REAL["31b-sliding"]
    q, cache, ind, ptr, kl = make_case([700, 1500], heads, kvh, hd, 16, seed=1, device="cuda")
    ind_buf = torch.zeros(400, dtype=torch.int32, device="cuda")
    ind_buf[: len(ind)] = ind
    out = torch.empty_like(q)
    splits = pick_splits(2, kvh, 132, window)

    def run():
        paged_decode_attention(q, cache, ind_buf, ptr, kl, window=window, num_splits=splits, out=out)

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    kl.copy_(torch.tensor([650, 30], dtype=torch.int32))  # within each row's pages (44 and 94)
    perm = torch.randperm(len(ind), device="cuda")
    ind_buf[: len(ind)] = ind[perm]
    g.replay()
    torch.cuda.synchronize()
    assert_close_to_ref(out, paged_decode_attention_ref(q, cache, ind_buf[: len(ind)], ptr, kl, window=window))


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
