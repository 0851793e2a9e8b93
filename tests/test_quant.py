"""FP8 / NVFP4 quantisation: quantiser error bounds, the W4A16 Triton kernel against its torch reference, FP8
linear, and model-level agreement of the quantised tiny models with the models built from the dequantised
weights. On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is
imported).

Tolerances (and why):
- NVFP4 W4A16: the kernel multiplies by exactly the dequantised weights (e2m1 * e4m3 is exact in bf16/fp32), so
  the quantised model reproduces the dequantised fp32 model up to accumulation order: logits max |diff| < 1e-4
  (measured ~1e-5 tiny, ~6e-6 tiny-moe), greedy tokens identical.
- FP8: weight-only mode reproduces the dequantised model the same way (< 1e-4, tokens identical). W8A8 (per-token
  activation rounding, ~2.5% relative per linear) is compared against the dequantised model whose linears
  fake-quantise their inputs per token (an independent forward pre-hook), < 1e-4 on CPU. The random tiny models
  are chaotic (1e-3 relative weight noise moves tiny's logits by ~3% and tiny-moe's by ~20%), so W8A8 against
  the unquantised-activation model is only reported, not held to a token-level tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

from perfkit.errors import PerfkitError
from perfkit.kernels.fp8 import (
    FP8_MAX,
    dequantize_fp8_rowwise,
    fp8_linear_ref,
    fp8_per_tensor_scale,
    quantize_fp8_per_token,
    quantize_fp8_rowwise,
)
from perfkit.kernels.w4a16_gemm import (
    DEQUANT_MM_MIN_M,
    E2M1_VALUES,
    GEMV_MAX_M,
    GEMV_MIN_PROGRAMS_PER_SM,
    MAX_SPLIT_K,
    W4A16Config,
    _split_k,
    _sweep_summary,
    dequantize_nvfp4,
    dequantize_nvfp4_triton,
    new_split_counter,
    pick_config,
    pick_path,
    quantize_nvfp4,
    repack_words,
    tc_split,
    unpack_e2m1,
    unrepack_words,
    w4a16_gemm,
    w4a16_gemm_gathered,
    w4a16_gemm_gathered_ref,
    w4a16_gemm_ref,
    w4a16_gemm_traffic,
)
from perfkit.runtime.attention.contiguous import ContiguousAttention
from perfkit.runtime.generate import greedy_generate
from perfkit.runtime.model_config import get_preset, to_hf_config
from perfkit.runtime.quant import (
    Fp8Linear,
    Nvfp4Linear,
    QuantizedExperts,
    apply_quant,
    dequantized_state_dict,
    is_modelopt_nvfp4,
    load_dequantized_,
    load_nvfp4_checkpoint,
    nvfp4_backend,
    quantize_model_,
)
from perfkit.runtime.weights import build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --------------------------------------------------------------------------------------------------------------
# Quantisers
# --------------------------------------------------------------------------------------------------------------


def test_e2m1_codes_and_packing():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = codes[0::2] | (codes[1::2] << 4)  # low nibble = even element
    vals = unpack_e2m1(packed)
    assert vals.tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    # every representable value (times a block scale) comes back as its own code
    w = torch.tensor(list(E2M1_VALUES) * 2 + [-v for v in E2M1_VALUES] * 2).view(2, 16) * 0.125
    q, s, gs = quantize_nvfp4(w)
    torch.testing.assert_close(unpack_e2m1(q), w / 0.125, atol=0, rtol=0)
    torch.testing.assert_close(dequantize_nvfp4(q, s, gs), w, atol=0, rtol=1e-6)


@pytest.mark.parametrize("std", [0.02, 1.0, 300.0])
def test_nvfp4_quantizer_error_bound(std):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen) * std
    w[3, 17] = 40 * std  # an outlier: its block gets a coarse scale, the others keep theirs
    q, s, gs = quantize_nvfp4(w)
    assert q.dtype == torch.uint8 and q.shape == (96, 128)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (96, 16) and gs.shape == ()
    torch.testing.assert_close(gs, w.abs().max() / (6 * 448))
    deq = dequantize_nvfp4(q, s, gs)
    # per element: half an e2m1 step at the top of the range (1 of 6) of the rounded block scale (+1/16)
    block_amax = w.abs().view(96, 16, 16).amax(-1, keepdim=True).expand(96, 16, 16).reshape(96, 256)
    assert ((deq - w).abs() <= block_amax / 6 * (1 + 1 / 16) + 1e-6 * std).all()
    assert rel(deq, w) < 0.11  # measured 0.095 for Gaussian weights


def test_nvfp4_stacked_matches_per_matrix():
    w = torch.randn(3, 2, 32, 64) * 0.02
    q, s, gs = quantize_nvfp4(w)
    assert gs.shape == (3, 2)
    q1, s1, g1 = quantize_nvfp4(w[2, 1])
    assert torch.equal(q[2, 1], q1) and torch.equal(s[2, 1].view(torch.uint8), s1.view(torch.uint8)) and g1 == gs[2, 1]
    torch.testing.assert_close(dequantize_nvfp4(q, s, gs)[2, 1], dequantize_nvfp4(q1, s1, g1))


def test_fp8_quantizers_error_bound():
    w = torch.randn(64, 80) * 0.05
    q, scale = quantize_fp8_rowwise(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    torch.testing.assert_close(scale, w.abs().amax(-1) / FP8_MAX)
    deq = dequantize_fp8_rowwise(q, scale)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; absolute <= 2^-10 * scale in the subnormals
    assert ((deq - w).abs() <= torch.maximum(w.abs() / 16, scale[:, None] * 2**-10) + 1e-9).all()
    x = torch.randn(5, 80)
    xq, xs = quantize_fp8_per_token(x)
    assert xs.shape == (5, 1)
    assert ((xq.float() * xs - x).abs() <= torch.maximum(x.abs() / 16, xs * 2**-10) + 1e-9).all()
    torch.testing.assert_close(fp8_per_tensor_scale(x), x.abs().max() / FP8_MAX)


# --------------------------------------------------------------------------------------------------------------
# W4A16 kernel
# --------------------------------------------------------------------------------------------------------------

# Small tiles: the test shapes (N = 40, K = 208) are multiples of none of them (K % 16 == 0 always).
TILES = {
    "gemv": W4A16Config(block_m=4, block_n=32, block_k=64, num_warps=4, num_stages=1),
    "dot": W4A16Config(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=1),
    "dequant_mm": W4A16Config(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1),
}
SPLIT_TILES = {  # K = 208 in 3 splits of 96 / 96 / 16
    "gemv": W4A16Config(block_m=2, block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=3),
    "dot": W4A16Config(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, split_k=3),
}
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # one ulp, relative (at most)


def _operands(M, N, K, dtype, seed=0, per_row_gs=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.02
    q, s, gs = quantize_nvfp4(w)
    if per_row_gs:
        gs = gs * (0.5 + torch.rand(N, generator=gen))
    x = torch.randn(M, K, generator=gen).to(dtype)
    return x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), gs.to(DEVICE)


def _assert_w4a16_close(out, x, q, s, gs, ref=None):
    """Kernel and reference multiply by the same exact dequantised weights (e2m1 * e4m3 is exact in fp32, bf16
    and fp16), so before the output cast they differ only by fp32 rounding: the order of the K-term sums (each
    within K * 2^-24 * sum |terms|) and where the global and block scales are applied (a few roundings more).
    That bound, elementwise, plus one ulp of the output dtype (rounding, or the CPU interpreter's truncation)."""
    ref = w4a16_gemm_ref(x, q, s, gs, out_dtype=torch.float32) if ref is None else ref
    mag = x.double().abs() @ dequantize_nvfp4(q, s, gs).double().abs().T  # sum |terms|
    bound = 2 * (x.shape[1] + 4) * 2.0**-24 * mag + ULP[out.dtype] * ref.double().abs() + 1e-30
    err = (out.double() - ref.double()).abs()
    assert (err <= bound).all(), (
        f"max err {err.max().item():.3g}, where bound {bound[err == err.max()].min().item():.3g}"
    )


@pytest.mark.parametrize("M", [1, 3, 8, 16, 33])
@pytest.mark.parametrize("path", ["gemv", "dot", "dequant_mm"])
def test_w4a16_paths_match_reference(path, M):
    """Every path at decode and odd sizes, bf16 activations (per-row global scale for odd M); small tiles that
    leave partial N, K and M tiles, and the default tile."""
    x, q, s, gs = _operands(M, 40, 208, torch.bfloat16, seed=M, per_row_gs=M % 2 == 1)
    ref = w4a16_gemm_ref(x, q, s, gs, out_dtype=torch.float32)
    for cfg in (TILES[path], None):
        out = w4a16_gemm(x, q, s, gs, config=cfg, path=path)
        assert out.dtype == torch.bfloat16 and out.shape == (M, 40)
        _assert_w4a16_close(out, x, q, s, gs, ref)
    _assert_w4a16_close(w4a16_gemm(x, q, s, gs, torch.float32, path=path), x, q, s, gs, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["gemv", "dot", "dequant_mm"])
def test_w4a16_dtypes_global_scales_and_fp32_out(path, dtype):
    for per_row_gs in (False, True):
        x, q, s, gs = _operands(3, 40, 208, dtype, seed=7, per_row_gs=per_row_gs)
        for out_dtype in (None, torch.float32):
            out = w4a16_gemm(x, q, s, gs, out_dtype=out_dtype, config=TILES[path], path=path)
            assert out.dtype == (out_dtype or dtype)
            _assert_w4a16_close(out, x, q, s, gs)
    # a Python float global scale, and a 0-d tensor (ModelOpt's weight_scale_2)
    g = float(gs.mean())
    ref = w4a16_gemm_ref(x, q, s, g, out_dtype=torch.float32)
    _assert_w4a16_close(w4a16_gemm(x, q, s, g, torch.float32, TILES[path], path=path), x, q, s, g, ref)
    _assert_w4a16_close(w4a16_gemm(x, q, s, torch.tensor(g), torch.float32, TILES[path], path=path), x, q, s, g, ref)


@pytest.mark.parametrize("path", ["gemv", "dot"])
def test_w4a16_split_k_is_correct_and_deterministic(path):
    for M in (1, 5):
        x, q, s, gs = _operands(M, 40, 208, torch.bfloat16, seed=11 + M, per_row_gs=True)
        out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=SPLIT_TILES[path], path=path)
        _assert_w4a16_close(out, x, q, s, gs)
        again = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=SPLIT_TILES[path], path=path)
        assert torch.equal(out, again)  # fixed-order reduction: bit-reproducible
    _assert_w4a16_close(w4a16_gemm(x, q, s, gs, config=SPLIT_TILES[path], path=path), x, q, s, gs)  # bf16 out


def test_w4a16_gemv_prefetch_two_steps_is_bit_identical():
    """prefetch=2 keeps two weight steps in flight; the accumulation order is unchanged, so the result is
    bit-identical to prefetch=1 (K tails and 1-3 steps per split included)."""
    for M, K, bk in ((1, 208, 32), (3, 208, 64), (2, 64, 32), (1, 32, 32)):
        x, q, s, gs = _operands(M, 40, K, torch.bfloat16, seed=20 + M, per_row_gs=True)
        one = W4A16Config(block_m=4, block_n=16, block_k=bk, num_warps=4, num_stages=1)
        two = dataclasses.replace(one, prefetch=2)
        out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=two, path="gemv")
        assert torch.equal(out, w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=one, path="gemv"))
        _assert_w4a16_close(out, x, q, s, gs)
    with pytest.raises(ValueError, match="bad gemv config"):
        w4a16_gemm(x, q, s, gs, config=dataclasses.replace(one, prefetch=3), path="gemv")


def test_w4a16_gemv_int64_x_is_bit_identical(monkeypatch):
    """bf16 x read as int64 words (GEMV_X64) feeds the same FMA chains as the 2-byte loads: bit-identical, K tails,
    several rows and the gathered (MoE) form included; unaligned or non-bf16 x keeps the 2-byte loads."""
    import perfkit.kernels.w4a16_gemm as wk

    for M, K, bk in ((1, 208, 32), (3, 208, 64), (4, 96, 64)):
        x, q, s, gs = _operands(M, 40, K, torch.bfloat16, seed=30 + M, per_row_gs=True)
        cfg = W4A16Config(block_m=4, block_n=16, block_k=bk, num_warps=4, num_stages=1, prefetch=2)
        monkeypatch.setattr(wk, "GEMV_X64", True)
        assert wk._x64(x)
        wide = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="gemv")
        monkeypatch.setattr(wk, "GEMV_X64", False)
        assert torch.equal(wide, w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="gemv"))
        _assert_w4a16_close(wide, x, q, s, gs)
    monkeypatch.setattr(wk, "GEMV_X64", True)
    assert not wk._x64(torch.zeros(1, 33, dtype=torch.bfloat16)[:, 1:])  # 2-byte offset
    assert not wk._x64(torch.zeros(1, 32, dtype=torch.float16))
    E, N, K = 3, 24, 64
    qe, se, ge = (t.to(DEVICE) for t in quantize_nvfp4(torch.randn(E, N, K) * 0.05))  # a global scale per expert
    x = torch.randn(4, K).to(torch.bfloat16).to(DEVICE)
    ids = torch.tensor([2, 0, 2, 1], device=DEVICE)
    wide = w4a16_gemm_gathered(x, qe, se, ge, ids, out_dtype=torch.float32)
    monkeypatch.setattr(wk, "GEMV_X64", False)
    assert torch.equal(wide, w4a16_gemm_gathered(x, qe, se, ge, ids, out_dtype=torch.float32))


WIDE = W4A16Config(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1, prefetch=2, wide=True)


def _spy_launches(monkeypatch, launcher: str, record=lambda args: 1) -> list:
    """``record(args)`` of each call of the w4a16 module's ``launcher`` (which kernel form ran is not visible in
    the output)."""
    import perfkit.kernels.w4a16_gemm as wk

    calls: list = []
    real = getattr(wk, launcher)

    def spy(*args, **kwargs):
        calls.append(record(args))
        return real(*args, **kwargs)

    monkeypatch.setattr(wk, launcher, spy)
    return calls


def _count_wide(monkeypatch) -> list[int]:
    """The launches of the wide M = 1 gemv kernel."""
    return _spy_launches(monkeypatch, "_launch_gemv_wide")


def test_w4a16_gemv_wide_matches_reference(monkeypatch):
    """The wide M = 1 kernel (16-byte weight loads, two row sets sharing x): within the fp32 bound of the
    reference and of the narrow kernel's result, for whole and ragged last steps (clamped vs masked prefetch), rows
    past N in either set, 1-3 steps, scalar and per-row global scales, bf16 and fp32 outputs."""
    calls = _count_wide(monkeypatch)
    for N, K, bk, per_row in ((40, 256, 64, True), (40, 224, 64, False), (5, 96, 32, True), (24, 64, 64, False)):
        x, q, s, gs = _operands(1, N, K, torch.bfloat16, seed=40 + N + K, per_row_gs=per_row)
        cfg = dataclasses.replace(WIDE, block_k=bk)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = w4a16_gemm(x, q, s, gs, out_dtype=out_dtype, config=cfg, path="gemv")
            _assert_w4a16_close(out, x, q, s, gs)
        narrow = dataclasses.replace(cfg, wide=False)
        ref = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=narrow, path="gemv")
        _assert_w4a16_close(w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="gemv"), x, q, s, gs, ref)
    assert len(calls) == 12


def test_w4a16_gemv_wide_decode_is_exact(monkeypatch):
    """One-hot x through the wide kernel picks single weights: equal to the reference bit for bit at 8 positions
    (first / last of a word, a scale group and a 32-element chunk, and two more), in 16 rows of permuted byte
    values (both row sets), with random block scales."""
    calls = _count_wide(monkeypatch)
    N, K = 16, 512
    gen = torch.Generator().manual_seed(5)
    q = torch.stack([torch.randperm(256, generator=gen) for _ in range(N)]).to(torch.uint8)
    s = (torch.rand(N, K // 16, generator=gen) * 300).to(torch.float8_e4m3fn)
    q_, s_, gs = q.to(DEVICE), s.to(DEVICE), torch.tensor(0.37, device=DEVICE)
    for col in (0, 7, 8, 15, 16, 31, 200, 511):  # positions in a word, a group, a 32-element chunk
        x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEVICE)
        x[0, col] = 1.0
        out = w4a16_gemm(x, q_, s_, gs, out_dtype=torch.float32, config=dataclasses.replace(WIDE, block_k=128))
        torch.testing.assert_close(out, w4a16_gemm_ref(x, q_, s_, gs, out_dtype=torch.float32), atol=0, rtol=0)
    assert len(calls) == 8


def test_w4a16_gemv_wide_falls_back_to_narrow(monkeypatch):
    """A wide tile runs the narrow kernel where the wide one does not apply: M > 1, fp16 x, K % 32 != 0, x not
    8-byte aligned, the gathered MoE form. Same results as the narrow tile (same kernel)."""
    calls = _count_wide(monkeypatch)
    narrow = dataclasses.replace(WIDE, wide=False)
    cases = [_operands(2, 24, 64, torch.bfloat16, seed=50), _operands(1, 24, 64, torch.float16, seed=51),
             _operands(1, 24, 48, torch.bfloat16, seed=52)]  # fmt: skip
    _, q, s, gs = _operands(1, 24, 64, torch.bfloat16, seed=53)
    x = torch.randn(1, 66, device=DEVICE).to(torch.bfloat16)[:, 2:]  # K = 64 at a 4-byte offset
    cases.append((x, q, s, gs))
    for x, q, s, gs in cases:
        out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=WIDE, path="gemv")
        assert torch.equal(out, w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=narrow, path="gemv"))
    qe, se, ge = (t.to(DEVICE) for t in quantize_nvfp4(torch.randn(3, 24, 64) * 0.05))
    xe, ids = torch.randn(1, 64).to(torch.bfloat16).to(DEVICE), torch.tensor([1], device=DEVICE)
    wide = w4a16_gemm_gathered(xe, qe, se, ge, ids, out_dtype=torch.float32, config=WIDE)
    assert torch.equal(wide, w4a16_gemm_gathered(xe, qe, se, ge, ids, out_dtype=torch.float32, config=narrow))
    assert calls == []
    with pytest.raises(ValueError, match="wide: the gemv path only"):
        w4a16_gemm(xe, qe[0], se[0], ge[0], config=dataclasses.replace(WIDE, block_m=16), path="dot")
    with pytest.raises(ValueError, match="block_k >= 32"):
        w4a16_gemm(xe, qe[0], se[0], ge[0], config=dataclasses.replace(WIDE, block_k=16), path="gemv")


def test_w4a16_pick_config_wide_by_grid(monkeypatch):
    """M = 1 with bf16 x and a known grid: the narrow tile below GEMV_WIDE_MIN_PROGRAMS_PER_SM programs of 16 rows
    per SM, the 1024-wide 8-warp tile up to GEMV_WIDE_DEEP_PROGRAMS_PER_SM, the 256-wide one up to
    GEMV_WIDE_SHORT_PROGRAMS_PER_SM, then the 512-wide one (the 31B and 26B-A4B shapes on 132 SMs as measured);
    everything else keeps its tile."""
    import perfkit.kernels.w4a16_gemm as wk

    monkeypatch.setattr(wk, "interpreting", lambda: False)
    assert pick_config(1, "gemv", torch.bfloat16, 2816, 132) is wk.GEMV_CONFIG
    assert pick_config(1, "gemv", torch.bfloat16, 5376, 132) is wk.GEMV_WIDE_DEEP_CONFIG
    assert pick_config(1, "gemv", torch.bfloat16, 16384, 132) is wk.GEMV_WIDE_SHORT_CONFIG
    assert pick_config(1, "gemv", torch.bfloat16, 18432, 132) is wk.GEMV_WIDE_SHORT_CONFIG  # 31B full-layer qkv
    assert pick_config(1, "gemv", torch.bfloat16, 43008, 132) is wk.GEMV_WIDE_CONFIG
    assert pick_config(1, "gemv", torch.float16, 43008, 132) is wk.GEMV_CONFIG
    assert pick_config(1, "gemv") is wk.GEMV_CONFIG  # no grid known
    assert pick_config(4, "gemv", torch.bfloat16, 43008, 132) is wk.GEMV_CONFIG


TC = W4A16Config(block_m=1, block_n=64, block_k=64, num_warps=4, num_stages=3, tc=True)


def _count_tc(monkeypatch) -> list[bool]:
    """The launches of the tensor-core gemv: whether each was given a counter (its splits summed in it)."""
    return _spy_launches(monkeypatch, "_launch_gemv_tc", lambda args: args[7] is not None)  # the counter


def test_w4a16_gemv_tc_matches_reference(monkeypatch):
    """The tensor-core M = 1 gemv (the decoded pairs as the MMA operand, K in the fragment's order, x gathered in
    that order): within the fp32 bound of the reference for rows past N, whole and ragged last steps (masked K
    tail), one and several splits summed by a second launch or in the same one (the counter back at zero after),
    scalar and per-row global scales, bf16 and fp32 outputs."""
    calls = _count_tc(monkeypatch)
    cases = ((40, 256, 64, None, True), (80, 1088, 128, 3, True), (80, 1088, 128, 3, False), (16, 512, 256, 1, False),
             (80, 1088, 64, 5, True))  # 17 steps in 5 splits: 3, 3, 3, 4, 4
    for N, K, bk, split, per_row in cases:
        x, q, s, gs = _operands(1, N, K, torch.bfloat16, seed=60 + N + K, per_row_gs=per_row)
        cfg = dataclasses.replace(TC, block_k=bk, split_k=split)
        counter = new_split_counter(N, DEVICE)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = w4a16_gemm(x, q, s, gs, out_dtype=out_dtype, config=cfg, path="gemv", split_counter=counter)
            _assert_w4a16_close(out, x, q, s, gs)
            assert not counter.any()
        _assert_w4a16_close(w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="gemv"), x, q, s, gs)
    assert calls == [True, True, False] * 5


def test_w4a16_gemv_tc_decode_and_k_order_are_exact(monkeypatch):
    """One nonzero weight per row, row r at column r (every position of a 64-element chunk and of the next one),
    with every code and random block scales: each output is one exact product times the global scale, rounded once,
    so the kernel must equal that bit for bit, which holds only if the decoded pair, the scale and the gathered x
    element all name the same K position."""
    calls = _count_tc(monkeypatch)
    N, K = 128, 256
    gen = torch.Generator().manual_seed(9)
    codes = torch.arange(N) % 15 + 1  # every nonzero code, both signs
    q = torch.zeros(N, K // 2, dtype=torch.uint8)
    q[torch.arange(N), torch.arange(N) // 2] = (codes << (4 * (torch.arange(N) % 2))).to(torch.uint8)
    s = (torch.rand(N, K // 16, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    q_, s_, x_, gs = q.to(DEVICE), s.to(DEVICE), x.to(DEVICE), torch.tensor(0.37, device=DEVICE)
    # the one product, exact in double, times the global scale, rounded once (the kernel's roundings)
    ref = ((x_.double() @ dequantize_nvfp4(q_, s_, 1.0).double().T) * gs.double()).float()
    for split in (1, 2):
        out = w4a16_gemm(x_, q_, s_, gs, out_dtype=torch.float32, config=dataclasses.replace(TC, split_k=split))
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert len(calls) == 2


def test_repack_words_is_a_bit_permutation_of_each_word():
    """repack_words moves each code's 4 bits inside its int32 word (the same 8 codes per word) and unrepack_words
    undoes it, for every byte value in every position; leading dims (stacked experts) pass through."""
    gen = torch.Generator().manual_seed(11)
    q = torch.stack([torch.randperm(256, generator=gen) for _ in range(12)]).to(torch.uint8).view(3, 4, 256)
    r = repack_words(q)
    assert r.shape == q.shape and r.dtype == torch.uint8 and not torch.equal(r, q)
    assert torch.equal(unrepack_words(r), q)
    popcount = [int(bin(v).count("1")) for v in range(256)]
    ones = torch.tensor(popcount)
    words_q, words_r = q.view(-1, 4).long(), r.view(-1, 4).long()
    assert torch.equal(ones[words_q].sum(1), ones[words_r].sum(1))  # same bits per word, moved


@pytest.mark.parametrize(
    "M,path,cfg",
    [(1, "gemv", TC), (1, "gemv", WIDE), (1, "gemv", None), (3, "gemv", None), (24, "dot", None),
     (160, "dequant_mm", None)],  # fmt: skip
)
def test_w4a16_repacked_words_give_the_same_result(M, path, cfg):
    """Every path reading the repacked words (``repacked=True``: the tensor-core gemv, the wide and narrow gemvs,
    the dot tile, the dequant pass) returns the standard words' result bit for bit: the same codes, decoded to the
    same values, summed in the same order. Ragged K (a masked last step) and per-row global scales included."""
    for K, per_row in ((512, False), (1088, True)):
        x, q, s, gs = _operands(M, 80, K, torch.bfloat16, seed=70 + M + K, per_row_gs=per_row)
        c = None if cfg is None else dataclasses.replace(cfg, block_k=64 if K % 256 else cfg.block_k)
        want = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=c, path=path)
        got = w4a16_gemm(x, repack_words(q), s, gs, out_dtype=torch.float32, config=c, path=path, repacked=True)
        assert torch.equal(got, want)


@pytest.mark.parametrize("repacked", [False, True])
def test_w4a16_gemv_tc_rows_are_each_rows_gemv(repacked, monkeypatch):
    """The tensor-core gemv at M = 2..16 (row m of x in column m of the MMA's B tile, loaded in memory order and
    permuted to the K order) and 33 (three programs per row block of 16 rows of x each, or two of 32 with
    ``tc_cols`` 32): each output row equals that row's M = 1 launch bit for bit (the columns of an MMA are summed apart) and the reference within the fp32 bound; 1 or 3 splits summed in the launch, a ragged last
    K step, per-row global scales, the counter back at zero."""
    calls = _count_tc(monkeypatch)
    for M, K, per_row in ((2, 512, False), (16, 1088, True), (7, 256, False), (33, 256, True)):
        x, q, s, gs = _operands(M, 80, K, torch.bfloat16, seed=90 + M, per_row_gs=per_row)
        w = repack_words(q) if repacked else q
        ref = w4a16_gemm_ref(x, q, s, gs, out_dtype=torch.float32)
        for split in (1, 3):
            cfg = dataclasses.replace(TC, block_k=64, split_k=split, tc_cols=32 if split == 3 else 16)
            counter = new_split_counter(80, DEVICE)
            out = w4a16_gemm(x, w, s, gs, out_dtype=torch.float32, config=cfg, path="gemv", split_counter=counter,
                             repacked=repacked)  # fmt: skip
            rows = [w4a16_gemm(x[i : i + 1], w, s, gs, out_dtype=torch.float32, config=cfg, path="gemv",
                               repacked=repacked) for i in range(M)]  # fmt: skip
            assert torch.equal(out, torch.cat(rows)) and not counter.any()
            torch.testing.assert_close(out, ref, atol=2e-6 * ref.abs().max().item(), rtol=0)
    assert len(calls) == sum(2 * (1 + M) for M in (2, 16, 7, 33))  # every launch on the tensor-core kernel


def test_w4a16_gemv_tc_config_rules(monkeypatch):
    """pick_config takes the tensor-core tile with bf16 x on tensor cores at M = 1 from GEMV_TC_MIN_ELEMENTS weight
    elements and K >= GEMV_TC_MIN_K, at M 2..GEMV_TC_MAX_M for any shape of whole K steps; a tc tile elsewhere
    (more than 4 groups of 16 rows, fp16 x)
    runs the narrow kernel with the same result; bad tc tiles and counters are refused; tc_split fills
    GEMV_TC_PROGRAMS_PER_SM programs per SM with whole steps."""
    import perfkit.kernels.w4a16_gemm as wk

    monkeypatch.setattr(wk, "interpreting", lambda: False)
    assert wk.GEMV_TC_MIN_K * 5376 >= wk.GEMV_TC_MIN_ELEMENTS > wk.GEMV_TC_MIN_K * 2816
    K = wk.GEMV_TC_MIN_K
    assert pick_config(1, "gemv", torch.bfloat16, 5376, 132, K, tensor_cores=True) is wk.GEMV_TC_CONFIG
    assert pick_config(1, "gemv", torch.bfloat16, 5376, 132, K - 64, tensor_cores=True) is wk.GEMV_WIDE_DEEP_CONFIG
    assert pick_config(1, "gemv", torch.bfloat16, 2816, 132, K, tensor_cores=True) is wk.GEMV_CONFIG  # too few
    assert pick_config(1, "gemv", torch.bfloat16, 5376, 132, K) is wk.GEMV_WIDE_DEEP_CONFIG
    assert pick_config(1, "gemv", torch.float16, 5376, 132, K, tensor_cores=True) is wk.GEMV_CONFIG
    assert pick_config(16, "gemv", torch.bfloat16, 5376, 132, K, tensor_cores=True) is wk.GEMV_TC_CONFIG
    cols = wk.GEMV_TC_COLS_CONFIG  # above 16 rows: 32 per program
    assert pick_config(17, "gemv", torch.bfloat16, 5376, 132, K * 2, tensor_cores=True) is cols
    assert pick_config(64, "gemv", torch.bfloat16, 5376, 132, K * 2, tensor_cores=True) is cols  # 2 programs
    assert pick_config(32, "gemv", torch.bfloat16, 5376, 132, K * 2) is wk.GEMV_CONFIG  # no tensor cores
    assert pick_config(32, "gemv", torch.bfloat16, 5376, 132, K, tensor_cores=True) is wk.GEMV_CONFIG  # 22 M: small
    assert pick_config(65, "gemv", torch.bfloat16, 5376, 132, K * 2, tensor_cores=True) is wk.GEMV_CONFIG
    assert pick_config(2, "gemv", torch.bfloat16, 4224, 132, 2816, tensor_cores=True) is wk.GEMV_TC_CONFIG  # any shape
    assert pick_config(2, "gemv", torch.bfloat16, 2816, 132, 2112, tensor_cores=True) is wk.GEMV_CONFIG  # but whole steps
    monkeypatch.undo()
    calls = _count_tc(monkeypatch)
    narrow = dataclasses.replace(TC, tc=False)
    for x, q, s, gs in (_operands(65, 24, 128, torch.bfloat16, seed=70), _operands(1, 24, 128, torch.float16, seed=71)):
        out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=TC, path="gemv")
        assert torch.equal(out, w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=narrow, path="gemv"))
    assert calls == []
    x, q, s, gs = _operands(1, 24, 128, torch.bfloat16, seed=72)
    for bad in (
        dataclasses.replace(TC, block_k=32),
        dataclasses.replace(TC, wide=True),
        dataclasses.replace(TC, block_n=8),
    ):
        with pytest.raises(ValueError, match="tc: the gemv path only"):
            w4a16_gemm(x, q, s, gs, config=bad, path="gemv")
    with pytest.raises(ValueError, match="split_counter must be int32"):
        bad_counter = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        w4a16_gemm(x, q, s, gs, config=dataclasses.replace(TC, split_k=2), path="gemv", split_counter=bad_counter)
    # the fullest waves of 4 x 132 programs (12-14 6-split.jsonl picks), at least 4 steps per split
    assert tc_split(5376, 21504, wk.GEMV_TC_CONFIG, 132) == 6  # 84 row blocks x 6: one wave, 95 % full
    assert tc_split(16384, 5376, wk.GEMV_TC_CONFIG, 132) == 2  # 512 programs, 10 and 11 steps
    assert tc_split(43008, 5376, wk.GEMV_TC_CONFIG, 132) == 2  # 85 % of 3 waves (3 splits: 95 % of 4)
    assert tc_split(18432, 5376, wk.GEMV_TC_CONFIG, 132) == 3  # 82 % of 2 waves (5 splits: 91 % of 3)
    assert tc_split(5376, 8192, wk.GEMV_TC_CONFIG, 132) == 6  # 32 steps: 5 or 6 per split
    assert tc_split(5376, 4096, wk.GEMV_TC_CONFIG, 132) == 4  # 16 steps: 4 splits at most
    assert tc_split(64, 256, dataclasses.replace(wk.GEMV_TC_CONFIG, split_k=9), 132) == 1


_TC_SM90_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from perfkit.kernels import w4a16_gemm as W

sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
       "count_ptr": "*i32"} | dict.fromkeys(("M", "stride_xm", "N", "K", "steps", "stride_wn", "stride_sn", "gs_stride"),
                                            "i32")
rows = []
for split, even, fused, pdl, rp, xr, fp8 in ((1, True, False, 0, 0, 1, 0), (6, True, True, 0, 0, 1, 0),
                                             (3, False, True, 0, 0, 1, 0), (2, True, False, 0, 0, 1, 0),
                                             (6, True, True, 1, 0, 1, 0), (6, True, True, 1, 1, 1, 0),
                                             (6, True, True, 1, 0, 16, 0), (6, True, True, 1, 1, 4, 0),
                                             (6, True, True, 1, 0, 1, 1), (6, True, True, 1, 0, 8, 1),
                                             (6, True, True, 1, 0, 16, 1), (6, True, True, 1, 0, 32, 1),
                                             (6, True, True, 1, 1, 32, 0)):
    consts = {"BN": 64, "BK": 128 if (xr > 8 and fp8) or xr == 32 else 256, "SPLIT": split, "EVEN_K": even,
              "FUSED": fused, "INTERP": False, "PDL": pdl, "RP": rp, "ROWS": xr, "FP8": fp8,
              "MG": {16: 4, 32: 2}.get(xr, 1), "NC": 32 if xr == 32 else 16}
    try:
        names = list(sig)  # the launch's specialisation at the 31B shapes: pointers, sizes and strides % 16 == 0
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in ("gs_stride", "M")}
        opts = {"num_warps": 4, "num_stages": 3} | ({"maxnreg": W.GEMV_TC_ROWS_MAX_REGISTERS} if xr > 1 else {})
        k = triton.compile(ASTSource(W._w4a16_gemv_tc_kernel, sig | dict.fromkeys(consts, "constexpr"), consts, attrs),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        a_in_regs = "warp_group_dot" in ttgir and "dot_op<{opIdx = 0" in ttgir and "mul.rn.bf16x2" in ptx
        a_in_regs = a_in_regs and ("shf.l.wrap" in ptx) == bool(rp) and (ptx.count("prmt.b32") >= 32) == bool(fp8)
        regs, stack = resource_usage(k)
        pdl_ok = ptx.count("griddepcontrol.wait") == pdl
        spill_ok = stack == 0 or (fp8 and xr == 8 and stack <= 16)  # 3 words at 8 rows: timed faster than 128-wide
        rows.append(a_in_regs and ("atom" in ptx) == fused and (regs <= 128 or not even) and spill_ok and pdl_ok)
    except Exception as exc:
        rows.append(f"{type(exc).__name__}: {exc}"[:2000])
print(json.dumps(rows))
"""


def test_w4a16_gemv_tc_compiles_for_sm90():
    """Ahead-of-time compile for sm_90 (no GPU; outside the interpreter, which runs the fp32 form instead of the
    PTX): the decoded tile reaches the warpgroup MMA as its register operand, the bf16x2 multiply is there, only
    the fused sum counts atomically, no variant spills (no stack), and with whole K steps (every 31B shape) the
    kernel keeps within 128 registers: the 4 programs per SM that ``tc_split`` plans with (127 in the 12-14
    compile; the masked K tail takes 134). Launched with PDL: one wait, the same registers. On repacked words
    (``repack_words``) the pairs decode by rotations, within the same registers. With M > 1 rows of x (ROWS 4 and
    16, launched with ``maxnreg``; at 16 rows as one of 4 row groups, M = 64) within 128 registers too, without
    spills. On FP8 words (``FP8``, the tiles of
    ``fp8_gemv``: 256-wide steps up to 8 rows, 128-wide for 16) the pairs come from ``prmt`` and the same bf16x2
    multiply (12-18 compile: 123 registers at M = 1; at 8 rows 128 registers and 16 bytes of stack, 3 words
    spilled, a form the H200 timed 1-6 % faster than the unspilled 128-wide step on 5 of the 6 31B shapes). With
    32 rows of x per program (``tc_cols`` 32, 128-wide steps), FP8 and repacked NVFP4, within 128 registers too."""
    from aot import sm90_rows

    assert sm90_rows(_TC_SM90_COMPILE) == [True] * 13


def test_w4a16_split_k_rule():
    """split-K only below GEMV_MIN_PROGRAMS_PER_SM programs per SM (the CPU counts as one SM), at most
    MAX_SPLIT_K and the number of K steps; whole K steps per split."""
    cpu, cfg = torch.device("cpu"), W4A16Config(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1)
    assert _split_k(cfg, cpu, programs=GEMV_MIN_PROGRAMS_PER_SM, K=4096) == (1, 4096)
    assert _split_k(cfg, cpu, programs=1, K=4096) == (GEMV_MIN_PROGRAMS_PER_SM, 2048)
    assert _split_k(cfg, cpu, programs=1, K=64) == (1, 64)  # one K step: nothing to split
    forced = W4A16Config(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=3)
    assert _split_k(forced, cpu, programs=1000, K=208) == (2, 128)  # 4 steps: 3 splits of 2 steps is 2 splits
    assert _split_k(forced, cpu, programs=1000, K=208 * 64)[0] == 3
    huge = W4A16Config(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=100)
    assert _split_k(huge, cpu, programs=1, K=64 * 100)[0] == MAX_SPLIT_K


@pytest.mark.parametrize("path", ["gemv", "dot"])
def test_w4a16_decode_is_exact(path):
    """One-hot rows of x pick single weights: kernel == reference bit for bit (no accumulation to differ in),
    over every byte value 0..255 in every byte position of a word and a scale group, and e4m3 block scales from
    subnormal to 448."""
    N, K = 16, 512  # each row holds all 256 byte values, in a different order
    gen = torch.Generator().manual_seed(3)
    q = torch.stack([torch.randperm(256, generator=gen) for _ in range(N)]).to(torch.uint8)
    s = torch.cat([torch.tensor([2.0**-9, 2.0**-6, 448.0, 1.0]), torch.rand(N * K // 16 - 4, generator=gen) * 300])
    s = s.to(torch.float8_e4m3fn).view(N, K // 16)
    gs = torch.tensor(0.37)
    cfg = W4A16Config(block_m=4 if path == "gemv" else 16, block_n=16, block_k=128, num_warps=4, num_stages=1)
    cols = torch.arange(16) * 33  # every position in a word (mod 8) and a group (mod 16), 16 different groups
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(16, K).to(dtype)
        x[torch.arange(16), cols] = 1.0
        x, q_, s_, gs_ = x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), gs.to(DEVICE)
        out = w4a16_gemm(x, q_, s_, gs_, out_dtype=torch.float32, config=cfg, path=path)
        torch.testing.assert_close(out, w4a16_gemm_ref(x, q_, s_, gs_, out_dtype=torch.float32), atol=0, rtol=0)


def test_nvfp4_dequant_kernel_is_exact():
    gen = torch.Generator().manual_seed(4)
    N, K = 24, 512
    q = torch.stack([torch.randperm(256, generator=gen) for _ in range(N)]).to(torch.uint8)
    s = (torch.rand(N, K // 16, generator=gen) * 448).to(torch.float8_e4m3fn)
    s[0, :4] = torch.tensor([2.0**-9, 2.0**-7, 448.0, 0.0]).to(torch.float8_e4m3fn)
    exact = dequantize_nvfp4(q, s, 1.0)  # fp32, exact
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for cfg in (None, W4A16Config(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1)):
            got = dequantize_nvfp4_triton(q.to(DEVICE), s.to(DEVICE), dtype, cfg)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float().cpu(), exact, atol=0, rtol=0)
    q2, s2 = q[:, :104], s[:, :13]  # K = 208: a partial K tile (and strided rows)
    torch.testing.assert_close(
        dequantize_nvfp4_triton(q2.to(DEVICE), s2.to(DEVICE), torch.float32, TILES["dequant_mm"]).cpu(),
        dequantize_nvfp4(q2, s2, 1.0),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize("scale_mode", ["broadcast", "gather", "reshape"])
def test_w4a16_dot_scale_modes(scale_mode):
    x, q, s, gs = _operands(5, 40, 208, torch.bfloat16, seed=3, per_row_gs=True)
    out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=TILES["dot"], scale_mode=scale_mode, path="dot")
    _assert_w4a16_close(out, x, q, s, gs)
    base = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=TILES["dot"], path="dot")
    assert torch.equal(out, base)  # same values, same accumulation order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swap_ab,scales_ahead", [(True, False), (False, True), (True, True)])
def test_w4a16_dot_swap_ab_and_scales_ahead(dtype, swap_ab, scales_ahead):
    """The transposed dot (swap_ab: out^T = W x^T, acc transposed in the epilogue) and the scales loaded a step
    ahead, against the reference: rows past M, columns past N (N 40 in a 64-row weight tile), K tails (EVEN_K off
    and on), split-K, per-column global scales, both scale modes. scales_ahead alone is the plain kernel bit for
    bit (the same values in the same order); fp32 swap_ab within 1e-6 of it (the dot may sum in another order)."""
    x, q, s, gs = _operands(5, 40, 208, dtype, seed=3, per_row_gs=True)
    cfg0 = W4A16Config(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1, swap_ab=swap_ab,
                       scales_ahead=scales_ahead)  # fmt: skip
    plain_cfg = dataclasses.replace(cfg0, swap_ab=False, scales_ahead=False)
    for cfg in (cfg0, dataclasses.replace(cfg0, block_k=32, split_k=3), dataclasses.replace(cfg0, block_k=16)):
        for mode in ("broadcast", "gather"):
            out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="dot", scale_mode=mode)
            _assert_w4a16_close(out, x, q, s, gs)
            plain = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=dataclasses.replace(
                plain_cfg, block_k=cfg.block_k, split_k=cfg.split_k), path="dot", scale_mode=mode)  # fmt: skip
            if not swap_ab:
                assert torch.equal(out, plain)
            elif dtype == torch.float32:
                torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="swap_ab / scales_ahead / scales_vec: the dot path only"):
        w4a16_gemm(x, q, s, gs, config=dataclasses.replace(cfg0, block_m=4), path="gemv")


def test_w4a16_dot_scales_vec_is_the_byte_loads_bit_for_bit():
    """scales_vec (each step's block scales as 4-byte vectors indexed by the loop), alone and with the scales
    ahead, split-K included: the plain kernel's output bit for bit (the same exact tiles, the same order). Where it
    cannot apply (a K tail; 32-wide steps; gathered scales) it falls back to the byte loads, still exact."""
    x, q, s, gs = _operands(5, 40, 256, torch.float32, seed=4, per_row_gs=True)
    base = W4A16Config(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1)
    for cfg in (base, dataclasses.replace(base, split_k=2), dataclasses.replace(base, block_k=32)):
        for mode in ("broadcast", "gather"):
            plain = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="dot", scale_mode=mode)
            for extra in ({"scales_vec": True}, {"scales_vec": True, "scales_ahead": True}):
                vec = dataclasses.replace(cfg, **extra)
                out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=vec, path="dot", scale_mode=mode)
                assert torch.equal(out, plain)
    x, q, s, gs = _operands(5, 40, 208, torch.float32, seed=4)  # 208 = 3 steps of 64 + a tail: the byte loads
    vec = dataclasses.replace(base, scales_vec=True)
    _assert_w4a16_close(w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=vec, path="dot"), x, q, s, gs)


def test_w4a16_dot_row_mask_is_the_clamped_rows_bit_for_bit(monkeypatch):
    """DOT_ROW_MASK (rows past M masked instead of clamped to row M - 1): the same output bit for bit, with whole
    K steps and with a K tail, M inside one row tile and across two."""
    import perfkit.kernels.w4a16_gemm as wk

    cfg = W4A16Config(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1)
    for M, K in ((5, 256), (21, 208)):
        x, q, s, gs = _operands(M, 40, K, torch.float32, seed=6)
        monkeypatch.setattr(wk, "DOT_ROW_MASK", False)
        clamped = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="dot")
        monkeypatch.setattr(wk, "DOT_ROW_MASK", True)
        masked = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="dot")
        assert torch.equal(masked, clamped)
        _assert_w4a16_close(masked, x, q, s, gs)


def test_w4a16_every_sweep_dot_tile_and_the_default_computes_the_product():
    """Each dot tile the H200 sweep times (SWEEP_CONFIGS["dot"], the 128-row swapped ones of 12-01i included) and
    DOT_SMALL_CONFIG (swapped since 12-01i, scales as vectors since 12-02) against the reference: 130 rows, two row
    blocks of the largest tile, columns past N, K over several steps."""
    import perfkit.kernels.w4a16_gemm as wk

    x, q, s, gs = _operands(130, 40, 256, torch.bfloat16, seed=5)
    tiles = {c for c in wk.SWEEP_CONFIGS["dot"] if c is not None} | {wk.DOT_SMALL_CONFIG}
    assert wk.DOT_SMALL_CONFIG.swap_ab and wk.DOT_SMALL_CONFIG.scales_vec
    for cfg in sorted(tiles, key=str):
        M = 130 if cfg.block_m >= 64 else 20
        out = w4a16_gemm(x[:M], q, s, gs, out_dtype=torch.float32, config=cfg, path="dot")
        _assert_w4a16_close(out, x[:M], q, s, gs)


def test_global_scale_runs_and_the_alpha_gemm():
    """The prefill GEMM's host runs of the global scale (one per merged module) and the cuBLAS-alpha product that
    writes each run's columns in place (here on the CPU, where torch.addmm takes the same views): within the
    reference's bound, so one rounding of the fp32 product, as the fp32 epilogue."""
    from perfkit.kernels.w4a16_gemm import _mm_alpha_runs, global_scale_runs

    gs = torch.tensor([0.5] * 3 + [2.0] * 4 + [0.5] * 2)
    assert global_scale_runs(gs, 9) == ((0, 3, 0.5), (3, 7, 2.0), (7, 9, 0.5))
    assert global_scale_runs(torch.tensor(0.25), 5) == ((0, 5, 0.25),)
    with pytest.raises(ValueError, match="1 or n=4"):
        global_scale_runs(gs, 4)
    x, q, s, gs40 = _operands(6, 40, 64, torch.bfloat16, seed=7)
    per_row = torch.cat([gs40.expand(16) * 0.75, gs40.expand(24) * 3.0])
    wd = dequantize_nvfp4(q, s, 1.0).to(torch.bfloat16)  # exact
    out = _mm_alpha_runs(x, wd, global_scale_runs(per_row, 40))
    assert out.dtype == torch.bfloat16 and out.shape == (6, 40)
    _assert_w4a16_close(out, x, q, s, per_row)
    with pytest.raises(ValueError, match="gs_runs must cover rows 0..40"):
        w4a16_gemm(x, q, s, per_row, gs_runs=((0, 16, 1.0),), path="dequant_mm")


def test_nvfp4_linear_caches_its_global_scale_runs():
    """Nvfp4Linear reads its global scale to the host once (the first prefill-sized call) and again only when the
    buffer is replaced or written in place; a merged q|k|v has one run per module."""
    lins = [torch.nn.Linear(32, n, bias=False) for n in (16, 8, 8)]
    parts = [Nvfp4Linear.from_linear(lin) for lin in lins]
    runs = parts[0]._gs_runs()
    assert runs == ((0, 16, parts[0].weight_scale_2.item()),) and parts[0]._gs_runs() is runs  # cached
    parts[0].weight_scale_2.mul_(2.0)  # a load in place: the version changes
    assert parts[0]._gs_runs()[0][2] == parts[0].weight_scale_2.item() != runs[0][2]
    for p, v in zip(parts, (0.5, 0.25, 0.5), strict=True):
        p.weight_scale_2.fill_(v)
    merged = Nvfp4Linear.merge_rows(parts)
    if merged is None:
        pytest.skip("the backend keeps separate GEMMs")
    assert merged.module._gs_runs() == ((0, 16, 0.5), (16, 24, 0.25), (24, 32, 0.5))


def test_w4a16_paths_and_configs():
    assert [pick_path(m) for m in (1, GEMV_MAX_M, GEMV_MAX_M + 1, DEQUANT_MM_MIN_M - 1, DEQUANT_MM_MIN_M)] == [
        "gemv", "gemv", "dot", "dot", "dequant_mm",
    ]  # fmt: skip
    assert pick_path(4096, "gemv") == "gemv"
    for bad in ("fast", "GEMV", ""):
        with pytest.raises(ValueError, match=r"path '.*': allowed values are auto, gemv, dot, dequant_mm"):
            pick_path(1, bad)
    x, q, s, gs = _operands(2, 40, 64, torch.float32)
    with pytest.raises(ValueError, match="allowed values are auto, gemv, dot, dequant_mm"):
        w4a16_gemm(x, q, s, gs, path="cublas")
    with pytest.raises(ValueError, match="allowed values are auto, gemv, dot, dequant_mm"):
        w4a16_gemm(x[:0], q, s, gs, path="cublas")  # validated before the empty shortcut
    with pytest.raises(ValueError, match="powers of two"):
        w4a16_gemm(x, q, s, gs, config=W4A16Config(4, 16, 48, 4, 1), path="gemv")
    with pytest.raises(ValueError, match="block_m and block_n >= 16"):
        w4a16_gemm(x, q, s, gs, config=W4A16Config(8, 16, 64, 4, 1), path="dot")
    with pytest.raises(ValueError, match="scale_mode"):
        w4a16_gemm(x, q, s, gs, scale_mode="lut")


def test_w4a16_strided_input_and_edge_cases():
    x, q, s, gs = _operands(6, 40, 64, torch.float32, seed=4)
    xt = torch.randn(64, 6, device=DEVICE).T  # non-contiguous [6, 64]
    for path in ("gemv", "dot", "dequant_mm"):
        _assert_w4a16_close(w4a16_gemm(xt, q, s, gs, path=path), xt, q, s, gs)
        assert w4a16_gemm(x[:0], q, s, gs, path=path).shape == (0, 40)
    with pytest.raises(ValueError, match="K % 16"):
        w4a16_gemm(torch.randn(2, 72, device=DEVICE), q, s, gs)


def test_w4a16_prefill_shape():
    x, q, s, gs = _operands(130, 48, 128, torch.float32, seed=5)
    for path in ("dequant_mm", "dot"):
        _assert_w4a16_close(w4a16_gemm(x, q, s, gs, path=path), x, q, s, gs)


@pytest.mark.parametrize("per_row_gs", [False, True])
def test_w4a16_gathered_matches_reference(per_row_gs):
    gen = torch.Generator().manual_seed(6)
    E, N, K, R = 5, 40, 208, 7
    q, s, gs = quantize_nvfp4(torch.randn(E, N, K, generator=gen) * 0.02)
    if per_row_gs:
        gs = gs[:, None] * (0.5 + torch.rand(E, N, generator=gen))
    ids = torch.tensor([4, 0, 4, 2, 1, 1, 3])  # repeated and distinct experts
    x = torch.randn(R, K, generator=gen)
    q, s, gs, ids, x = (t.to(DEVICE) for t in (q, s, gs, ids, x))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for cfg in (None, TILES["gemv"]):  # block_m is unused: one row per program
            out = w4a16_gemm_gathered(xd, q, s, gs, ids, out_dtype=torch.float32, config=cfg)
            torch.testing.assert_close(
                out, w4a16_gemm_gathered_ref(xd, q, s, gs, ids, torch.float32), atol=1e-6, rtol=1e-5
            )
            for r in range(R):  # row r == plain GEMM against expert ids[r], within the accumulation bound
                e = int(ids[r])
                _assert_w4a16_close(out[r : r + 1], xd[r : r + 1], q[e], s[e], gs[e])
        assert w4a16_gemm_gathered(xd, q, s, gs, ids).dtype == dtype
    assert w4a16_gemm_gathered(x[:0], q, s, gs, ids[:0]).shape == (0, N)


def test_w4a16_sweep_summary():
    """The sweep's summary: the best tile per (M range, path) by geometric-mean time relative to each shape's
    fastest measurement, then the fastest path per M."""
    cfg_a, cfg_b = {"block_n": 16}, {"block_n": 32}
    rows = [
        {"M": 1, "N": 8, "K": 16, "path": "gemv", "config": cfg_a, "graph_ms": 1.0},
        {"M": 1, "N": 8, "K": 16, "path": "gemv", "config": cfg_b, "graph_ms": 2.0},
        {"M": 1, "N": 8, "K": 32, "path": "gemv", "config": cfg_a, "graph_ms": 4.0},
        {"M": 1, "N": 8, "K": 32, "path": "gemv", "config": cfg_b, "graph_ms": 1.0},
        {"M": 1, "N": 8, "K": 32, "path": "dot", "config": cfg_a, "graph_ms": 3.0},
        {"M": 64, "N": 8, "K": 16, "path": "dot", "config": cfg_a, "graph_ms": 1.0},
        {"M": 64, "N": 8, "K": 16, "path": "gemv", "config": cfg_a, "error": "OutOfResources"},
    ]
    summary = _sweep_summary(rows)
    best = {(d["m_range"], d["path"]): d for d in summary if d["summary"] == "best_config"}
    assert best[("1", "gemv")]["config"] == cfg_b  # geomean(2, 1) < geomean(1, 4)
    assert best[("1", "gemv")]["geomean_time_vs_best"] == pytest.approx(2**0.5, abs=1e-3)
    assert best[("17-127", "dot")]["shapes"] == 1 and ("17-127", "gemv") not in best
    paths = {d["M"]: d["path"] for d in summary if d["summary"] == "best_path"}
    assert paths == {1: "gemv", 64: "dot"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the sweep's CPU flow (interpreter); a GPU runs the real one")
def test_w4a16_sweep_runs_end_to_end(monkeypatch):
    """The GPU sweep's flow on CPU at toy shapes (timers stubbed): one JSON line per (shape, path, tile) with the
    bench keys and a correct result, a failing tile recorded as an error, then the summary lines."""
    import triton

    import perfkit.kernels.w4a16_gemm as wk

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    lines = []
    bad = W4A16Config(block_m=4, block_n=16, block_k=48, num_warps=4, num_stages=1)  # not a power of two
    results = wk.sweep_w4a16(
        shapes=[(1, 40, 64), (130, 40, 64)],
        configs={"gemv": (None, TILES["gemv"], bad)},
        log=lines.append,
        device="cpu",
    )
    rows = [json.loads(line) for line in lines]
    assert rows == json.loads(json.dumps(results))
    measured = [r for r in rows if "graph_ms" in r]
    # gemv x 3 tiles at M = 1 (one fails), dot and dequant_mm once each at both M (gemv skipped at M = 130)
    assert len(measured) == 2 + 2 + 2 and all(r["rel_err_vs_ref"] < 1e-2 for r in measured)
    assert {
        "median_ms",
        "bound_ms",
        "pct_of_bound",
        "stream_ms",
        "graph_pct_of_stream",
        "bf16_cublas_ms",
        "path",
        "config",
    } <= set(measured[0])
    assert [r["path"] for r in rows if "error" in r] == ["gemv"]
    assert {r["summary"] for r in rows if "summary" in r} == {"best_config", "best_path"}


def test_w4a16_main_without_cuda_exits_2(capsys, monkeypatch):
    import perfkit.kernels.w4a16_gemm as wk

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wk._main(["--sweep"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "CUDA" in out[0]
    assert wk._main([]) == 0  # no --sweep: the help


def test_w4a16_traffic():
    t = w4a16_gemm_traffic(1, 5376, 21504)
    weight = 5376 * 21504 // 2 + 5376 * 21504 // 16 + 4
    assert t["weight_bytes"] == weight
    assert t["total_bytes"] == weight + 2 * 21504 + 2 * 5376
    assert t["flops"] == 2 * 5376 * 21504
    assert t["bound_ms"] == pytest.approx(t["total_bytes"] / 4.3e12 * 1e3)


# --------------------------------------------------------------------------------------------------------------
# FP8 linear and the quantised modules
# --------------------------------------------------------------------------------------------------------------


def test_fp8_linear_module_matches_reference():
    lin = torch.nn.Linear(96, 48, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.02)
    x = torch.randn(2, 5, 96)
    m = Fp8Linear.from_linear(lin)
    y = m(x)
    assert y.shape == (2, 5, 48)
    # independent reference: fake-quantise x per token, dequantise W per channel, fp32 matmul
    xs = x.reshape(-1, 96).abs().amax(-1, keepdim=True) / 448
    xq = (x.reshape(-1, 96) / xs).to(torch.float8_e4m3fn).float() * xs
    wdq = m.weight.float() * (lin.weight.abs().amax(-1) / 448)[:, None]
    torch.testing.assert_close(y.reshape(-1, 48), xq @ wdq.T, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y.reshape(-1, 48), fp8_linear_ref(x.reshape(-1, 96), m.weight, m.weight_scale))
    assert rel(y, lin(x)) < 0.05  # weight + activation rounding: measured ~0.03
    m.quantize_input = False
    torch.testing.assert_close(m(x), x @ m.dequantized_weight().T, atol=1e-6, rtol=1e-5)


def test_nvfp4_linear_module_matches_dequantized():
    lin = torch.nn.Linear(64, 40, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.02)
    m = Nvfp4Linear.from_linear(lin)
    assert m.backend == nvfp4_backend("cpu") == ("w4a16-triton" if os.environ.get("TRITON_INTERPRET") else "w4a16-ref")
    x = torch.randn(3, 4, 64)
    torch.testing.assert_close(m(x), x @ m.dequantized_weight().T, atol=1e-6, rtol=1e-5)
    m.backend = "w4a16-ref"
    torch.testing.assert_close(m(x), x @ m.dequantized_weight().T, atol=1e-6, rtol=1e-5)
    assert rel(m.dequantized_weight(), lin.weight) < 0.11


# --------------------------------------------------------------------------------------------------------------
# Model level
# --------------------------------------------------------------------------------------------------------------


def _logits(model, ids):
    attn = ContiguousAttention()
    attn.prepare(ids.numel(), torch.zeros_like(ids))
    return model(ids, torch.arange(ids.numel()), attn)


def _pair(preset, scheme, seed=0):
    """(quantised model, unquantised model holding the dequantised weights, original model, report)."""
    base = build_model(get_preset(preset), "cpu", torch.float32, seed=seed)
    q = copy.deepcopy(base)
    report = quantize_model_(q, scheme)
    ref = copy.deepcopy(base)
    load_dequantized_(ref, q)
    return q, ref, base, report


PROMPT = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_nvfp4_model_matches_dequantized_model(preset):
    q, ref, base, report = _pair(preset, "nvfp4")
    lq, lr = _logits(q, PROMPT), _logits(ref, PROMPT)
    assert (lq - lr).abs().max().item() < 1e-4
    assert torch.equal(lq.argmax(-1), lr.argmax(-1))
    assert greedy_generate(q, PROMPT[:6].tolist(), 6) == greedy_generate(ref, PROMPT[:6].tolist(), 6)
    # the report: every decoder linear but the router quantised, ~7x fewer bytes for them
    n_lin = sum(isinstance(m, Nvfp4Linear) for m in q.modules())
    assert report.num_linear == n_lin > 0 and report.backend == nvfp4_backend("cpu")
    assert 6.0 < report.compression < 7.2  # bf16 would be 3.6x: 32 bits -> 4.5 bits (fp32 source)
    assert (
        report.model_bytes_after
        == report.model_bytes_before - report.quantized_bytes_before + report.quantized_bytes_after
    )
    assert isinstance(q.embed_tokens, torch.nn.Embedding) and q.embed_tokens.weight.dtype == torch.float32
    if preset == "tiny-moe":
        assert report.num_expert_modules == 6 and report.expert_backend is not None
        assert all(isinstance(layer.experts, QuantizedExperts) for layer in q.layers)
        assert all(isinstance(layer.router.proj, torch.nn.Linear) for layer in q.layers)
        assert len(report.kept) == 6 and all("router" in k for k in report.kept)


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
def test_moe_prefill_dequant_model_logits_match(scheme, monkeypatch):
    """A whole quantised tiny-moe prefill of 40 tokens (80 routed pairs) with moe_prefill=dequant at a threshold
    it crosses: the same logits (fp32: to accumulation order) as the quantized arm, and for NVFP4 as the
    dequantised model."""
    monkeypatch.setattr(QuantizedExperts, "dequant_min_pairs", 16)
    q, ref, _, _ = _pair("tiny-moe", scheme)
    if not all(m.backend in ("w4a16-triton", "fp8-triton") for m in q.modules() if isinstance(m, QuantizedExperts)):
        pytest.skip("the torch expert backends (CPU without the interpreter) have no dequant path")
    q.set_moe_prefill("quantized")
    lq = _logits(q, PROMPT)
    assert q.set_moe_prefill("dequant")
    ld = _logits(q, PROMPT)
    assert (ld - lq).abs().max().item() < 1e-4
    if scheme == "nvfp4":  # (FP8's W8A8 linears quantise x, so its dequantised twin differs more)
        assert (ld - _logits(ref, PROMPT)).abs().max().item() < 1e-4


def test_moe_gather_and_sorted_paths_agree():
    q, ref, _, _ = _pair("tiny-moe", "nvfp4", seed=2)
    layer = q.layers[0]
    x = torch.randn(20, 64)
    w, idx = layer.router(x)
    e = layer.experts
    g, s = e.forward_gather(x, idx, w), e.forward_sorted(x, idx, w)
    exp = ref.layers[0].experts.forward_sorted(x, idx, w)
    torch.testing.assert_close(g, exp, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s, exp, atol=1e-5, rtol=1e-4)


def test_moe_gather_toggle_reaches_the_quantised_experts():
    """Toggle moe_gather: the model sets gather_kernels on its quantised experts (and says it has some), the engine
    reports and switches it live, a dense model has none, a bad value is refused. (The two paths' numerics:
    test_quantized_experts_gather_kernels_switch; through a whole bf16 model, top-k routing flips on rounding.)"""
    from perfkit.runtime.engine import Engine, EngineConfig

    q, _, base, _ = _pair("tiny-moe", "nvfp4")
    experts = [m for m in q.modules() if isinstance(m, QuantizedExperts)]
    assert experts and q.set_moe_gather("kernels") and all(m.gather_kernels for m in experts)
    assert q.set_moe_gather("gemv") and not any(m.gather_kernels for m in experts)
    assert not base.set_moe_gather("kernels")  # no quantised experts: no path changes
    with pytest.raises(ValueError, match="moe_gather"):
        q.set_moe_gather("fast")
    ec = EngineConfig(
        attention="torch", page_size=4, num_kv_pages=64, cuda_graphs=False, mask="dense", max_model_len=64
    )
    eng = Engine(q, get_preset("tiny-moe"), ec)  # the default, kernels, set on the experts the test left on gemv
    assert eng.toggles()["moe_gather"] == "kernels" and all(m.gather_kernels for m in experts)
    eng.set_toggle("moe_gather", "gemv")
    assert eng.toggles()["moe_gather"] == "gemv" and not any(m.gather_kernels for m in experts)
    with pytest.raises(PerfkitError, match="unknown toggle"):
        eng.set_toggle("moe_gather", "fast")


def test_moe_prefill_toggle_routes_prefill_sizes_to_the_dequant_path(monkeypatch):
    """Toggle moe_prefill: the model sets prefill_dequant on its quantised experts, the engine reports and switches
    it live; with dequant, pairs at or above dequant_min_pairs take fused_moe_quantized(path="dequant") and fewer
    stay on the sorted GEMMs; the quantized arm never takes it; auto (the default) takes it for NVFP4 experts only
    (measured on the H200, 12-01i), not for FP8 ones; a bad value is refused."""
    import perfkit.runtime.quant as quant_mod
    from perfkit.runtime.engine import Engine, EngineConfig

    q, _, base, _ = _pair("tiny-moe", "nvfp4")
    experts = [m for m in q.modules() if isinstance(m, QuantizedExperts)]
    assert experts and q.set_moe_prefill("dequant") and all(m.prefill_dequant for m in experts)
    assert not base.set_moe_prefill("dequant")
    with pytest.raises(ValueError, match="moe_prefill"):
        q.set_moe_prefill("fast")
    e = experts[0]
    paths = []
    monkeypatch.setattr(quant_mod, "fused_moe_quantized", lambda x, *a, path="sorted", **k: paths.append(path) or x)
    monkeypatch.setattr(e, "backend", "w4a16-triton")
    monkeypatch.setattr(e, "dequant_min_pairs", 8)
    monkeypatch.setattr(e, "gather_kernels", False)
    H = e.hidden
    for T, K in ((40, 2), (3, 2)):  # 80 pairs (>= 8 and above the gemv gather's 64), 6 pairs
        idx = torch.zeros(T, K, dtype=torch.long)
        e(torch.zeros(T, H), idx, torch.ones(T, K))
    assert paths == ["dequant"]  # 6 pairs: the gemv gather (not fused_moe_quantized)
    e.prefill_dequant = False
    e(torch.zeros(40, H), torch.zeros(40, 2, dtype=torch.long), torch.ones(40, 2))
    assert paths == ["dequant", "sorted"]
    e.prefill_dequant = None  # auto
    e(torch.zeros(40, H), torch.zeros(40, 2, dtype=torch.long), torch.ones(40, 2))
    monkeypatch.setattr(e, "backend", "fp8-triton")
    e(torch.zeros(40, H), torch.zeros(40, 2, dtype=torch.long), torch.ones(40, 2))
    assert paths == ["dequant", "sorted", "dequant", "sorted"]
    ec = EngineConfig(
        attention="torch", page_size=4, num_kv_pages=64, cuda_graphs=False, mask="dense", max_model_len=64
    )
    q.set_moe_prefill("quantized")
    eng = Engine(q, get_preset("tiny-moe"), ec)  # the default, auto (12-01i), set on the experts
    assert eng.toggles()["moe_prefill"] == "auto" and all(m.prefill_dequant is None for m in experts)
    eng.set_toggle("moe_prefill", "quantized")
    assert eng.toggles()["moe_prefill"] == "quantized" and all(m.prefill_dequant is False for m in experts)
    eng.set_toggle("moe_prefill", "dequant")
    assert all(m.prefill_dequant is True for m in experts)
    with pytest.raises(PerfkitError, match="unknown toggle"):
        eng.set_toggle("moe_prefill", "fast")


def _quant_experts(scheme: str, E: int, H: int, inter: int, seed: int, device: str = DEVICE) -> QuantizedExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * inter, H, generator=gen) * 0.05)
    experts.down_proj = torch.nn.Parameter(torch.randn(E, H, inter, generator=gen) * 0.05)
    return QuantizedExperts.from_experts(experts.to(device), scheme)


def _routed(T: int, H: int, E: int, K: int, gen: torch.Generator, dtype=torch.float32):
    """x [T, H] and a top-K routing over E experts (weights, ids), made on the host from ``gen``, on DEVICE."""
    x = torch.randn(T, H, generator=gen).to(dtype)
    w, idx = torch.topk(torch.randn(T, E, generator=gen).softmax(-1), K)
    return x.to(DEVICE), w.to(DEVICE), idx.to(DEVICE)


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,block_m", [(3, None), (40, None), (40, 32)])
def test_fused_moe_quantized_matches_reference(scheme, dtype, T, block_m):
    """The grouped, in-register-dequantising expert GEMMs (interpreter) against fused_moe_ref on the dequantised
    weights: K tails (inter 48 with 32-wide K tiles), gate/up rows with different global scales, T*K above and
    below the gather threshold, unused padded blocks."""
    from perfkit.kernels.moe import fused_moe_quantized, fused_moe_ref

    E, H, inter, K = 6, 64, 48, 2
    e = _quant_experts(scheme, E, H, inter, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, w, idx = _routed(T, H, E, K, gen, dtype)
    gu, dn = e.quant_weights("gate_up_proj"), e.quant_weights("down_proj")
    y = fused_moe_quantized(x, gu, dn, w, idx, block_m=block_m)
    ref = fused_moe_ref(x.float(), gu.dequantize(), dn.dequantize(), w, idx)
    assert y.dtype == dtype and y.shape == (T, H)
    if dtype == torch.float32:  # accumulation order
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    else:  # act / y / out roundings (outputs ~0.02: a relative norm, not an absolute tolerance of that size)
        assert rel(y.float(), ref) < 1.5e-2


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [3, 40])
def test_fused_moe_quantized_dequant_path_matches_reference(scheme, dtype, T):
    """path="dequant" (every expert dequantised into a scratch in x's dtype without its row scale, then the bf16
    path's grouped GEMMs with the row scales in their epilogues) against fused_moe_ref and the sorted path: gate
    and up rows with different global scales, K tails, partial blocks; the scratch is exact (dequantize_experts
    times the row scale is the reference's weights)."""
    from perfkit.kernels.moe import QUANT_MOE_PATHS, dequantize_experts, fused_moe_quantized, fused_moe_ref

    E, H, inter, K = 6, 64, 48, 2
    e = _quant_experts(scheme, E, H, inter, seed=3)
    x, w, idx = _routed(T, H, E, K, torch.Generator().manual_seed(4), dtype)
    gu, dn = e.quant_weights("gate_up_proj"), e.quant_weights("down_proj")
    for wq in (gu, dn):
        torch.testing.assert_close(dequantize_experts(wq, torch.float32) * wq.row_scale[..., None], wq.dequantize(),
                                   atol=0, rtol=0)  # fmt: skip
        assert dequantize_experts(wq, torch.bfloat16).dtype == torch.bfloat16
    y = fused_moe_quantized(x, gu, dn, w, idx, path="dequant")
    ref = fused_moe_ref(x.float(), gu.dequantize(), dn.dequantize(), w, idx)
    assert y.dtype == dtype and y.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    else:
        assert rel(y.float(), ref) < 1.5e-2
        assert rel(y.float(), fused_moe_quantized(x, gu, dn, w, idx).float()) < 1e-2  # the same roundings
    assert QUANT_MOE_PATHS == ("sorted", "gather", "dequant")
    with pytest.raises(ValueError, match="'sorted', 'gather', 'dequant'"):
        fused_moe_quantized(x, gu, dn, w, idx, path="dense")


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
@pytest.mark.parametrize("T", [3, 40])
def test_fused_moe_quantized_swap_ab_matches_reference(scheme, T):
    """The transposed sorted GEMMs (SWAP_AB: weight rows on the dot's M side, the block's rows on its N side,
    acc transposed in the epilogue) against fused_moe_ref: K tails (inter 48 in 32-wide steps), partial blocks, N
    tiles past the rows. An unknown tile key is an error, SCALES_AHEAD included (removed on 12-02)."""
    from perfkit.kernels.moe import fused_moe_quantized, fused_moe_ref

    E, H, inter, K = 6, 64, 48, 2
    e = _quant_experts(scheme, E, H, inter, seed=3)
    x, w, idx = _routed(T, H, E, K, torch.Generator().manual_seed(4))
    gu, dn = e.quant_weights("gate_up_proj"), e.quant_weights("down_proj")
    ref = fused_moe_ref(x, gu.dequantize(), dn.dequantize(), w, idx)
    t = {"BLOCK_N": 64, "BLOCK_K": 32, "SWAP_AB": True}  # gate_up: 64 > I = 48 rows; down: one 64-row tile
    y = fused_moe_quantized(x, gu, dn, w, idx, gate_up_tiles=t, down_tiles=t)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    for bad in ({"BLOCK_M": 32}, {"SCALES_AHEAD": True}):
        with pytest.raises(ValueError, match="unknown tile keys"):
            fused_moe_quantized(x, gu, dn, w, idx, down_tiles=bad)


@pytest.mark.parametrize("T", [3, 40])
def test_fused_moe_quantized_scales_vec_matches_byte_scales(T):
    """The sorted NVFP4 GEMMs with their block scales addressed from the loop index as 4-byte vectors (SCALES_VEC),
    asked for and by default: bit for bit the byte loads' output (the same exact tiles, the same sums), and close
    to fused_moe_ref; transposed (SWAP_AB), another summation order, within 1e-5 of it. Where K or the K step is
    not a multiple of 64 (or K of the step) the flag falls back to the byte loads (``scales_vec_fit``)."""
    from perfkit.kernels.moe import fused_moe_quantized, fused_moe_ref, scales_vec_fit

    E, H, inter, K = 6, 128, 64, 2
    e = _quant_experts("nvfp4", E, H, inter, seed=5)
    x, w, idx = _routed(T, H, E, K, torch.Generator().manual_seed(6))
    gu, dn = e.quant_weights("gate_up_proj"), e.quant_weights("down_proj")
    ref = fused_moe_ref(x, gu.dequantize(), dn.dequantize(), w, idx)
    base = {"BLOCK_N": 32, "BLOCK_K": 64, "SCALES_VEC": False}
    plain = fused_moe_quantized(x, gu, dn, w, idx, gate_up_tiles=base, down_tiles=base)
    torch.testing.assert_close(plain, ref, atol=1e-5, rtol=1e-5)
    for extra in ({"SCALES_VEC": True}, {}):  # {}: the default, on
        t = {**{k: v for k, v in base.items() if k != "SCALES_VEC"}, **extra}
        assert torch.equal(fused_moe_quantized(x, gu, dn, w, idx, gate_up_tiles=t, down_tiles=t), plain)
    swapped = {**base, "SCALES_VEC": True, "SWAP_AB": True}  # the transposed form with the vectors: another order
    y = fused_moe_quantized(x, gu, dn, w, idx, gate_up_tiles=swapped, down_tiles=swapped)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert scales_vec_fit(128, {"BLOCK_K": 64, "SCALES_VEC": True})
    assert not scales_vec_fit(128, {"BLOCK_K": 64, "SCALES_VEC": False})
    assert not scales_vec_fit(96, {"BLOCK_K": 64, "SCALES_VEC": True})  # a partial last step
    assert not scales_vec_fit(64, {"BLOCK_K": 32, "SCALES_VEC": True})  # 2 scales per row and step


@pytest.mark.parametrize("T,H,inter,K", [(1, 64, 32, 4), (3, 96, 64, 2)])
def test_fused_moe_quantized_gather_path_matches_reference(T, H, inter, K):
    """The NVFP4 gather kernels (interpreter): gate_up + GeGLU per pair and down + routing weight + combine per
    token, against fused_moe_ref on the dequantised weights and against the sorted path; whole and ragged K
    steps (H 96 with 64-wide steps), gate/up rows with their own global scales, a weight-0 slot (reads nothing in
    gate_up, adds 0 in down). Other formats and x dtypes are refused."""
    from perfkit.kernels.moe import _fused_moe_gather_w4a16, fused_moe_quantized, fused_moe_ref

    E = 5
    e = _quant_experts("nvfp4", E, H, inter, seed=7 + H)
    gen = torch.Generator().manual_seed(8)
    x, w, idx = _routed(T, H, E, K, gen, torch.bfloat16)
    w[0, -1] = 0.0
    gu, dn = e.quant_weights("gate_up_proj"), e.quant_weights("down_proj")
    ref = fused_moe_ref(x.float(), gu.dequantize(), dn.dequantize(), w, idx)
    y = fused_moe_quantized(x, gu, dn, w, idx, path="gather")
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    assert rel(y.float(), ref) < 1.5e-2  # bf16 act and out roundings (0.6-0.7 %, as the sorted path)
    assert rel(y.float(), fused_moe_quantized(x, gu, dn, w, idx).float()) < 1.5e-2
    assert rel(fused_moe_quantized(x, gu, dn, w, (idx + 1) % E, path="gather").float(), ref) > 0.5  # can fail
    tiles = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 1}  # several programs per row range and K steps
    y2 = _fused_moe_gather_w4a16(x, gu, dn, w, idx, gate_up_tiles=tiles, down_tiles=tiles)
    assert rel(y2.float(), ref) < 1.5e-2
    with pytest.raises(ValueError, match="gather path needs NVFP4"):
        fused_moe_quantized(x.float(), gu, dn, w, idx, path="gather")
    f8 = _quant_experts("fp8", E, H, inter, seed=9)
    with pytest.raises(ValueError, match="gather path needs NVFP4"):
        fused_moe_quantized(x, f8.quant_weights("gate_up_proj"), f8.quant_weights("down_proj"), w, idx, path="gather")
    with pytest.raises(ValueError, match="'sorted', 'gather', 'dequant'"):
        fused_moe_quantized(x, gu, dn, w, idx, path="auto")


def test_quantized_experts_gather_kernels_switch(monkeypatch):
    """QuantizedExperts.gather_kernels routes NVFP4 batches of up to gather_kernels_max_rows pairs through the
    gather kernels (bf16 x only; fp32 x keeps the gemv gather), larger ones to the sorted GEMMs, with the same
    result as the torch loop; on by default (the H200 A/B of 12-01f)."""
    import perfkit.runtime.quant as quant

    assert quant.QuantizedExperts.gather_kernels is True
    calls = []
    real = quant.fused_moe_quantized
    monkeypatch.setattr(quant, "fused_moe_quantized", lambda *a, **k: calls.append(k.get("path")) or real(*a, **k))
    e = _quant_experts("nvfp4", 5, 64, 32, seed=10)
    gen = torch.Generator().manual_seed(11)
    x, w, idx = _routed(2, 64, 5, 2, gen)
    want = e.forward_sorted(x.float(), idx, w)
    assert rel(e(x.to(torch.bfloat16), idx, w).float(), want) < 1.5e-2
    assert calls == ["gather"]
    calls.clear()
    e(x, idx, w)  # fp32 x: the gemv gather
    assert calls == []
    for T, path in ((40, "gather"), (129, "sorted")):  # 80 pairs: above gather_max_rows; 258: above the kernels' 256
        x, w, idx = _routed(T, 64, 5, 2, gen, torch.bfloat16)
        calls.clear()
        assert rel(e(x, idx, w).float(), e.forward_sorted(x.float(), idx, w)) < 1.5e-2
        assert calls == [path]
    monkeypatch.setattr(quant.QuantizedExperts, "gather_kernels", False)
    calls.clear()
    x, w, idx = _routed(2, 64, 5, 2, gen)
    assert rel(e(x.to(torch.bfloat16), idx, w).float(), e.forward_sorted(x, idx, w)) < 1.5e-2  # the gemv gather
    assert calls == []


def test_quantized_experts_keep_other_ranks_pairs_at_weight_zero_under_tp(monkeypatch):
    """Expert parallelism over the Triton backends: tp._ExpertParallel passes every [T, K] pair to the kernels,
    other ranks' at weight 0 (sync-free, graph-capturable), at any size; it used to drop them through a host sync
    above 64 pairs. The half of the experts this rank holds gives the sum of those experts' pairs only."""
    import perfkit.runtime.quant as quant
    from perfkit.runtime.tp import TPInfo, _ExpertParallel, _swap_class

    calls = []
    real = quant.fused_moe_quantized
    monkeypatch.setattr(quant, "fused_moe_quantized", lambda *a, **k: calls.append(tuple(a[4].shape)) or real(*a, **k))
    for scheme in ("nvfp4", "fp8"):
        full = _quant_experts(scheme, 4, 32, 16, seed=20)
        part = _quant_experts(scheme, 4, 32, 16, seed=20)
        assert full.fused and part.fused  # the interpreter's Triton backends
        _swap_class(part, _ExpertParallel)
        part.tp, part.tp_expert_start, part.tp_num_local_experts = TPInfo(rank=0, world_size=1), 0, 4
        x, w, idx = _routed(40, 32, 4, 2, torch.Generator().manual_seed(21), torch.bfloat16)  # 80 pairs
        calls.clear()
        assert torch.equal(part(x, idx, w), full(x, idx, w))  # every expert local: the same kernels, same bits
        assert calls == [(40, 2), (40, 2)]  # the [T, K] form both times, no [n, 1] rows after a nonzero()
        part.tp_num_local_experts = 2  # experts 0, 1 here
        mine = idx < 2
        want = full(x, torch.where(mine, idx, 0), torch.where(mine, w, torch.zeros_like(w)))
        assert torch.equal(part(x, idx, w), want)
    ref = _quant_experts("fp8", 4, 32, 16, seed=20)
    ref.backend = "fp8-dequant"
    assert not ref.fused  # the torch loop syncs anyway: the TP wrapper drops other ranks' pairs


def test_quantized_experts_backends_route_to_the_grouped_kernels(monkeypatch):
    """w4a16-triton: gemv gather up to gather_max_rows pairs, grouped kernels above; fp8-triton: grouped kernels
    at every size; both equal the torch loop (forward_sorted)."""
    import perfkit.runtime.quant as quant

    calls = []
    real = quant.fused_moe_quantized
    monkeypatch.setattr(quant, "fused_moe_quantized", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for scheme, backend in (("nvfp4", "w4a16-triton"), ("fp8", "fp8-triton")):
        e = _quant_experts(scheme, 5, 32, 16, seed=1)
        assert e.backend == backend  # conftest runs the CPU suite under the interpreter
        gen = torch.Generator().manual_seed(2)
        for T in (2, 40):
            x, w, idx = _routed(T, 32, 5, 2, gen)
            calls.clear()
            torch.testing.assert_close(e(x, idx, w), e.forward_sorted(x, idx, w), atol=1e-5, rtol=1e-4)
            grouped = backend == "fp8-triton" or T * 2 > e.gather_max_rows
            assert calls == ([T] if grouped else [])
    with pytest.raises(ValueError, match="expert weights"):
        quant.QuantExpertWeights("fp8", torch.zeros(2, 4, 8, dtype=torch.uint8), None, torch.ones(2, 4))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fp8_model_matches_dequantized_model(preset):
    q, ref, base, report = _pair(preset, "fp8")
    assert report.backend == "fp8-ref" and 3.5 < report.compression < 4.0
    # W8A8 vs the dequantised model whose linears fake-quantise their inputs per token (independent hook)
    quantised_names = {n for n, m in q.named_modules() if isinstance(m, Fp8Linear)}

    def fake_quant_input(_mod, args):
        (x,) = args
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
        return ((x / s).to(torch.float8_e4m3fn).float() * s,)

    hooks = [m.register_forward_pre_hook(fake_quant_input) for n, m in ref.named_modules() if n in quantised_names]
    lq, lr = _logits(q, PROMPT), _logits(ref, PROMPT)
    assert (lq - lr).abs().max().item() < 1e-4
    for h in hooks:
        h.remove()
    # weight-only FP8 reproduces the plain dequantised model, tokens identical
    for m in q.modules():
        if isinstance(m, Fp8Linear):
            m.quantize_input = False
    lq, lr = _logits(q, PROMPT), _logits(ref, PROMPT)
    assert (lq - lr).abs().max().item() < 1e-4
    assert greedy_generate(q, PROMPT[:6].tolist(), 6) == greedy_generate(ref, PROMPT[:6].tolist(), 6)


def test_apply_quant_and_dequantized_state_dict():
    model = build_model(get_preset("tiny"), "cpu", torch.float32, seed=0)
    assert apply_quant(model, "bf16") is None
    rep = apply_quant(model, "nvfp4")
    assert apply_quant(model, "nvfp4") is rep  # idempotent for a model already quantised
    with pytest.raises(PerfkitError, match="already quantised"):
        apply_quant(model, "fp8")
    sd = dequantized_state_dict(model)
    assert "layers.0.self_attn.q_proj.weight" in sd and "embed_tokens.weight" not in sd
    assert sd["layers.0.mlp.down_proj.weight"].shape == (64, 128)
    with pytest.raises(PerfkitError, match="scheme"):
        quantize_model_(build_model(get_preset("tiny"), "cpu", torch.float32), "int4")


# --------------------------------------------------------------------------------------------------------------
# ModelOpt NVFP4 checkpoint loading
# --------------------------------------------------------------------------------------------------------------


def _write_checkpoint(tmp_path, preset, unfused_experts):
    from safetensors.torch import save_file

    cfg = get_preset(preset)
    q = build_model(cfg, "cpu", torch.float32, seed=5)
    quantize_model_(q, "nvfp4")
    tensors = {}
    for name, t in q.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if unfused_experts and prefix.endswith(".experts"):
            continue
        tensors["model.language_model." + name] = t.contiguous()
    if unfused_experts:
        for i, layer in enumerate(q.layers):
            e = layer.experts
            im = e.intermediate
            for x in range(e.num_experts):
                for proj, src, rows in (
                    ("gate_proj", "gate_up_proj", slice(0, im)),
                    ("up_proj", "gate_up_proj", slice(im, 2 * im)),
                    ("down_proj", "down_proj", slice(None)),
                ):
                    p = f"model.language_model.layers.{i}.experts.{x}.{proj}."
                    tensors[p + "weight"] = getattr(e, src)[x, rows].contiguous()
                    tensors[p + "weight_scale"] = getattr(e, f"{src}_weight_scale")[x, rows].contiguous()
                    tensors[p + "weight_scale_2"] = getattr(e, f"{src}_weight_scale_2")[x, rows][0].clone()
                    tensors[p + "input_scale"] = torch.tensor(1.0)
    # scalars as 0-d tensors, as ModelOpt stores them
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = to_hf_config(cfg)
    hf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return cfg, q


@pytest.mark.parametrize("preset,unfused", [("tiny", False), ("tiny-moe", False), ("tiny-moe", True)])
def test_load_modelopt_nvfp4_checkpoint(tmp_path, preset, unfused):
    cfg, q = _write_checkpoint(tmp_path, preset, unfused)
    assert is_modelopt_nvfp4(tmp_path)
    loaded = load_nvfp4_checkpoint(tmp_path, "cpu", torch.float32, cfg=cfg)
    assert loaded.quant_report.num_linear == q.quant_report.num_linear
    assert apply_quant(loaded, "nvfp4") is loaded.quant_report
    for name, t in q.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == t.dtype, name
        if t.dtype == torch.float8_e4m3fn:
            got, t = got.view(torch.uint8), t.view(torch.uint8)
        assert torch.equal(got, t), name
    torch.testing.assert_close(_logits(loaded, PROMPT), _logits(q, PROMPT), atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# GPU (H200): real 31B shapes, 2 layers
# --------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
def test_gpu_31b_two_layers_quantized_vs_dequantized_bf16(scheme):
    """Quantised bf16 model vs the fp32 model holding the dequantised weights; the bf16 model holding the same
    dequantised weights gives the bf16 noise floor of this (random, hence sensitive) model."""
    cfg = get_preset("31b", num_layers=2)
    q = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    ref32 = copy.deepcopy(q).float()
    ref32.setup_rope()
    report = quantize_model_(q, scheme)
    load_dequantized_(ref32, q)
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ref16.setup_rope()
    ids = torch.randint(3, 200000, (300,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        for n in (300, 8, 1):  # prefill-shaped (M=300) and decode-shaped (M=8: the tc gemv's rows; M=1) GEMMs
            l32 = _logits(ref32, ids[:n])
            lq, l16 = _logits(q, ids[:n]), _logits(ref16, ids[:n])
            err, floor = rel(lq, l32), rel(l16, l32)
            top1 = (lq.argmax(-1) == l32.argmax(-1)).float().mean().item()
            print(
                f"{scheme} M={n}: backend={report.backend} rel logits err={err:.4f} (bf16 floor {floor:.4f}) top1={top1:.3f}"
            )
            # nvfp4 W4A16 computes with the exact dequantised weights: bf16-level noise only; fp8 W8A8 adds
            # per-token activation rounding (~2.5% relative per linear)
            assert err < (max(0.05, 3 * floor) if scheme == "nvfp4" else max(0.25, 10 * floor))
    print(report.to_dict())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["auto", "gemv", "dot", "dequant_mm"])
@pytest.mark.parametrize("M,N,K", [(1, 5376, 21504), (1, 21504, 5376), (4, 8192, 5376), (16, 5376, 8192)])
def test_gpu_w4a16_real_shapes_and_timing(M, N, K, path):
    from perfkit.kernels.w4a16_gemm import bench_w4a16

    r = bench_w4a16(M, N, K, path=path)
    print(r)
    assert r["rel_err_vs_ref"] < 5e-3  # bf16 output rounding (~1e-3); the weights are exact
    assert r["chain_us"] > 0 and r["chain_pct_of_stream"] == pytest.approx(100 * r["stream_chain_us"] / r["chain_us"])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [(5376, 8192), (43008, 5376), (4224, 2816)])
def test_gpu_w4a16_gemv_tc_real_shapes_and_graph_replays(N, K):
    """The tensor-core gemv (inline-PTX bf16x2 decode, wgmma) at 31B / 26B-A4B decode shapes: the default tile with
    its splits summed in the same launch against the reference bound and against a second-launch sum (same partials,
    same order: bit for bit), one-hot rows exact, and a CUDA graph of three launches replayed with new x: equal to
    eager, the counter back at zero. The 26B-A4B's 4224 x 2816 (CUDA cores by default; one split by ``tc_split``)
    with 3 splits forced."""
    import perfkit.kernels.w4a16_gemm as wk

    gen = torch.Generator().manual_seed(N + K)
    q, s, gs = (t.cuda() for t in quantize_nvfp4(torch.randn(N, K, generator=gen) * 0.02))
    cfg = wk.GEMV_TC_CONFIG if K >= wk.GEMV_TC_MIN_K else dataclasses.replace(wk.GEMV_TC_CONFIG, split_k=3)
    counter = new_split_counter(N, "cuda")
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    fused = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="gemv", split_counter=counter)
    _assert_w4a16_close(fused, x, q, s, gs)
    assert torch.equal(fused, w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, path="gemv"))
    assert not counter.any() and wk.tc_split(N, K, cfg, wk.sm_count(x.device)) > 1
    onehot = torch.zeros(1, K, device="cuda", dtype=torch.bfloat16)
    onehot[0, K // 3] = 1.0
    exact = w4a16_gemm_ref(onehot, q, s, gs, out_dtype=torch.float32)
    assert torch.equal(w4a16_gemm(onehot, q, s, gs, out_dtype=torch.float32, config=cfg, split_counter=counter), exact)
    xs = torch.randn(3, 1, K, device="cuda").to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_outs = [w4a16_gemm(xs[i], q, s, gs, config=cfg, split_counter=counter) for i in range(3)]
    for _ in range(2):
        xs.copy_(torch.randn(3, 1, K, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        outs = [w4a16_gemm(xs[i], q, s, gs, config=cfg, split_counter=counter) for i in range(3)]
        for a, b in zip(g_outs, outs, strict=True):
            assert torch.equal(a, b)
    assert not counter.any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "M,N,K,path",
    [(1, 5376, 8192, "gemv"), (1, 43008, 5376, "gemv"), (1, 4224, 2816, "gemv"), (3, 8192, 5376, "gemv"),
     (24, 5376, 8192, "dot"), (300, 8192, 5376, "dequant_mm")],  # fmt: skip
)
def test_gpu_w4a16_repacked_words_bit_identical(M, N, K, path):
    """The repacked words (``repack_words``, ``repacked=True``) through the compiled kernels at 31B / 26B-A4B shapes
    (the tensor-core gemv with its in-launch split sum, the wide gemv at K 2816, the narrow gemv, the dot tile, the
    dequant pass + cuBLAS): bit for bit the standard words' result, the split counter back at zero."""
    gen = torch.Generator().manual_seed(N + K + M)
    q, s, gs = (t.cuda() for t in quantize_nvfp4(torch.randn(N, K, generator=gen) * 0.02))
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    counter = new_split_counter(N, "cuda") if M == 1 else None
    want = w4a16_gemm(x, q, s, gs, path=path, split_counter=counter)
    got = w4a16_gemm(x, repack_words(q), s, gs, path=path, split_counter=counter, repacked=True)
    assert torch.equal(got, want)
    assert counter is None or not counter.any()


@pytest.mark.gpu
@gpu
def test_gpu_engine_tokens_identical_with_repacked_words():
    """31B with 2 layers and NVFP4 weights: FlashInfer, CUDA graphs, the fused path, PDL, staggered lengths (mixed
    steps, then batch-1 tails on the tensor-core gemv): w4a16_words auto and repacked give the standard words'
    tokens, and so does switching to repacked on a live engine; auto repacks the shapes ``repack_pays`` names."""
    from perfkit.kernels.w4a16_gemm import repack_pays
    from perfkit.runtime.engine import Engine, EngineConfig
    from perfkit.runtime.quant import quantize_model_

    cfg = get_preset("31b", num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    quantize_model_(model, "nvfp4")
    gen = torch.Generator().manual_seed(29)
    reqs = [torch.randint(3, cfg.vocab_size, (int(n),), generator=gen).tolist() for n in (7, 40, 130, 300, 17, 64)]
    kw = dict(attention="flashinfer", cuda_graphs=True, page_size=16, max_batch_size=8, max_num_tokens=512,
              num_kv_pages=2000, max_model_len=1024, mask="triton", fused_kernels=True, pdl=True)  # fmt: skip

    def run(e):
        rids = [e.add_request(p, max_new_tokens=6 + (i % 4) * 7) for i, p in enumerate(reqs)]
        got = e.generate_all()
        e.bm.check_no_leaks()
        return [got[r] for r in rids]

    outs, words = [], []
    for mode in ("standard", "auto", "repacked"):
        e = Engine(model, cfg, EngineConfig(**kw, w4a16_words=mode))
        words.append(e.stats.w4a16_words)
        outs.append(run(e))
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("w4a16_words", "repacked")
    outs.append(run(live))
    assert outs[0] == outs[1] == outs[2] == outs[3]
    auto = {k: "repacked" if repack_pays(*map(int, k.split("x")), "cuda") else "standard" for k in words[1]}
    assert words[1] == auto and "repacked" in auto.values() and set(words[0].values()) == {"standard"}
    assert set(words[2].values()) == {"repacked"}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [(5376, 21504), (43008, 5376), (5376, 8192), (4224, 2816)])
def test_gpu_w4a16_gemv_tc_rows_real_shapes(N, K, monkeypatch):
    """M = 2..16 on w4a16_gemm's auto path at 31B and 26B-A4B shapes (K 2816: CUDA cores at M = 1, the tensor
    cores from M = 2): the tensor-core gemv takes them (not the dot path), each
    output row bit for bit its own M = 1 launch of that kernel, within the reference's fp32 bound; with PDL and in
    a CUDA graph replayed with new x equal to eager; the counter back at zero."""
    import perfkit.kernels.w4a16_gemm as wk

    calls = _count_tc(monkeypatch)
    gen = torch.Generator().manual_seed(N + K + 1)
    q, s, gs = (t.cuda() for t in quantize_nvfp4(torch.randn(N, K, generator=gen) * 0.02))
    counter = new_split_counter(N, "cuda")
    for M in (2, 4, 9, 16):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, split_counter=counter, pdl=M == 4)
        rows = [w4a16_gemm(x[i : i + 1], q, s, gs, out_dtype=torch.float32, config=wk.GEMV_TC_CONFIG, path="gemv",
                           split_counter=counter) for i in range(M)]  # fmt: skip
        assert torch.equal(out, torch.cat(rows))
        _assert_w4a16_close(out, x, q, s, gs)
    assert len(calls) == sum(1 + M for M in (2, 4, 9, 16)) and all(calls) and not counter.any()
    xs = torch.randn(4, K, device="cuda").to(torch.bfloat16)
    w4a16_gemm(xs, q, s, gs, split_counter=counter)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = w4a16_gemm(xs, q, s, gs, split_counter=counter)
    xs.copy_(torch.randn(4, K, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, w4a16_gemm(xs, q, s, gs, split_counter=counter)) and not counter.any()


@pytest.mark.gpu
@gpu
def test_gpu_w4a16_pdl_chain_equals_plain():
    """PDL launches of the M = 1 gemv kernels in a dependent chain (each reads the output of the one before, an
    rmsnorm between, as in a decode layer): wide 5376 x 2816 -> tensor-core 8192 x 5376 -> rmsnorm -> tensor-core
    2816 x 8192, twice, captured in a CUDA graph and replayed with new x: bit for bit the plain eager chain (same
    kernels, same split order), counters back at zero."""
    import perfkit.kernels.w4a16_gemm as wk
    from perfkit.kernels.rmsnorm import rmsnorm

    gen = torch.Generator().manual_seed(15)
    layers = [tuple(t.cuda() for t in quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05))
              for n, k in ((5376, 2816), (8192, 5376), (2816, 8192))]  # fmt: skip
    dev = torch.device("cuda")
    picks = [wk.pick_config(1, "gemv", torch.bfloat16, q.shape[0], wk.sm_count(dev), 2 * q.shape[1], True)
             for q, _, _ in layers]  # fmt: skip
    assert [c.wide for c in picks] == [True, False, False] and [c.tc for c in picks] == [False, True, True]
    counters = [new_split_counter(q.shape[0], dev) for q, _, _ in layers]
    norm_w = torch.rand(8192, device=dev).to(torch.bfloat16) + 0.5

    def chain(x, pdl):
        for _ in range(2):
            h = w4a16_gemm(x, *layers[0], split_counter=counters[0], pdl=pdl)
            h = w4a16_gemm(h, *layers[1], split_counter=counters[1], pdl=pdl)
            h = rmsnorm(h, norm_w, 1e-6, pdl=pdl)
            x = w4a16_gemm(h, *layers[2], split_counter=counters[2], pdl=pdl) * 0.05
        return x

    xs = torch.randn(1, 2816, device=dev).to(torch.bfloat16)
    chain(xs, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(xs, True)
    for _ in range(3):
        xs.copy_(torch.randn(1, 2816, device=dev).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(xs, False))
    assert not any(c.any() for c in counters)


@pytest.mark.gpu
@gpu
def test_gpu_w4a16_prefill_alpha_runs():
    """dequant_mm at a prefill M with the global scale as host runs (cuBLAS alpha, x's dtype written directly)
    against the reference bound and the fp32-epilogue form; a merged-style per-row scale of three runs; both
    forms timed at the 31B gate|up shape with 8K tokens (printed: what Nvfp4Linear.prefill_alpha is decided on);
    an Nvfp4Linear forward at M = 256 with prefill_alpha takes it."""
    from perfkit.kernels.w4a16_gemm import global_scale_runs

    x, q, s, gs = _operands(256, 4096, 2048, torch.bfloat16, seed=11)
    per_row = torch.cat([gs.expand(2048) * 0.5, gs.expand(1024) * 2.0, gs.expand(1024)])
    for g in (gs, per_row):
        runs = global_scale_runs(g, 4096)
        fast = w4a16_gemm(x, q, s, g, path="dequant_mm", gs_runs=runs)
        _assert_w4a16_close(fast, x, q, s, g)
        slow = w4a16_gemm(x, q, s, g, path="dequant_mm")
        assert (fast.float() - slow.float()).abs().max() <= 2 * 2.0**-8 * slow.float().abs().max()
    from perfkit.kernels.timing import graph_ms

    x, q, s, gs = _operands(8192, 21504, 5376, torch.bfloat16, seed=12)  # the 31B gate|up projection, an 8K chunk
    runs = global_scale_runs(gs, 21504)
    fast_ms = graph_ms(lambda: w4a16_gemm(x, q, s, gs, path="dequant_mm", gs_runs=runs))
    slow_ms = graph_ms(lambda: w4a16_gemm(x, q, s, gs, path="dequant_mm"))
    print(f"dequant_mm 8192 x 21504 x 5376: alpha runs {fast_ms:.3f} ms, fp32 epilogue {slow_ms:.3f} ms")
    lin = torch.nn.Linear(2048, 4096, bias=False, device="cuda")
    m = Nvfp4Linear.from_linear(lin)
    m.prefill_alpha = True
    y = m(x[:256, :2048].contiguous())
    assert m._gs_runs_cache is not None and y.shape == (256, 4096)


@pytest.mark.gpu
@gpu
def test_gpu_w4a16_default_tiles_exact_and_deterministic():
    """The GPU-only code (inline-PTX conversion, wgmma tiles, the GPU default tiles) against the reference at
    a real width: one-hot rows bit-exact on every path, random rows within the accumulation bound, split-K runs
    bit-identical."""
    gen = torch.Generator().manual_seed(8)
    N, K = 5376, 4096
    q, s, gs = quantize_nvfp4(torch.randn(N, K, generator=gen) * 0.02)
    q, s, gs = q.cuda(), s.cuda(), gs.cuda()
    exact = dequantize_nvfp4(q, s, 1.0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(dequantize_nvfp4_triton(q, s, dtype).float(), exact)
    onehot = torch.zeros(16, K, device="cuda", dtype=torch.bfloat16)
    onehot[torch.arange(16), torch.arange(16) * 257] = 1.0
    ref = w4a16_gemm_ref(onehot, q, s, gs, out_dtype=torch.float32)
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
    for path in ("gemv", "dot", "dequant_mm"):
        assert torch.equal(w4a16_gemm(onehot, q, s, gs, out_dtype=torch.float32, path=path), ref), path
        for M in (1, 16):
            _assert_w4a16_close(w4a16_gemm(x[:M], q, s, gs, out_dtype=torch.float32, path=path), x[:M], q, s, gs)
    for path, split in (("gemv", 4), ("dot", 3)):
        cfg = dataclasses.replace(pick_config(16, path), split_k=split)
        a = w4a16_gemm(x, q, s, gs, config=cfg, path=path)
        assert torch.equal(a, w4a16_gemm(x, q, s, gs, config=cfg, path=path))
        _assert_w4a16_close(a, x, q, s, gs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
def test_gpu_quantized_experts_real_shapes_and_graph_capture(scheme):
    """26B-A4B expert shapes (E 128, H 2816, I 704, top-8) on the GPU: the grouped kernels (tensor-core dots on
    the exact dequantised tiles) against the fp32 reference at decode and prefill sizes, and a CUDA-graph capture
    of the forward at T = 64 (the sorted side synced on the host before 12-01c, so no graph above batch 8); the
    dequant prefill path (toggle moe_prefill) at T = 512 against the reference and the sorted GEMMs."""
    from perfkit.kernels.moe import fused_moe_ref

    e = _quant_experts(scheme, 128, 2816, 704, seed=5, device="cuda")
    assert e.backend == ("w4a16-triton" if scheme == "nvfp4" else "fp8-triton")
    gu, dn = e.gate_up_proj, e.down_proj
    ref_w = e.quant_weights("gate_up_proj").dequantize(), e.quant_weights("down_proj").dequantize()
    gen = torch.Generator("cuda").manual_seed(6)
    for T in (1, 16, 64, 512):
        x = torch.randn(T, 2816, device="cuda", generator=gen).to(torch.bfloat16)
        w, idx = torch.topk(torch.randn(T, 128, device="cuda", generator=gen).softmax(-1), 8)
        err = rel(e(x, idx, w), fused_moe_ref(x.float(), *ref_w, w, idx))
        print(f"{scheme} T={T}: rel err {err:.2e}")
        assert err < 1e-2  # bf16 x, act and y roundings; the weights are exact
    x = torch.randn(64, 2816, device="cuda", dtype=torch.bfloat16)
    w, idx = torch.topk(torch.randn(64, 128, device="cuda").softmax(-1), 8)
    _assert_graph_replays_eager(lambda: e(x, idx, w))
    assert e.gate_up_proj is gu and e.down_proj is dn
    e.prefill_dequant = True  # toggle moe_prefill=dequant; 512 x 8 = 4096 pairs, below the default threshold
    e.dequant_min_pairs = 4096
    x = torch.randn(512, 2816, device="cuda", generator=gen).to(torch.bfloat16)
    w, idx = torch.topk(torch.randn(512, 128, device="cuda", generator=gen).softmax(-1), 8)
    ref = fused_moe_ref(x.float(), *ref_w, w, idx)
    dq = e(x, idx, w)
    e.prefill_dequant = False
    err, vs_sorted = rel(dq, ref), rel(dq.float(), e(x, idx, w).float())
    print(f"{scheme} dequant T=512: rel err {err:.2e}, vs the sorted GEMMs {vs_sorted:.2e}")
    assert err < 1e-2 and vs_sorted < 1e-2


def _assert_graph_replays_eager(fn) -> None:
    """fn() captured in a CUDA graph and replayed gives the eager result bit for bit."""
    eager = fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@gpu
def test_gpu_nvfp4_gather_kernels_real_shapes_and_graph_capture(monkeypatch):
    """QuantizedExperts.gather_kernels on the GPU at 26B-A4B expert shapes (E 128, H 2816, I 704, top-8): the two
    NVFP4 gather kernels against the fp32 reference and the gemv gather at T = 1, 8 and 32 (256 pairs,
    gather_kernels_max_rows), and replayed from a CUDA graph bit for bit."""
    import perfkit.runtime.quant as quant
    from perfkit.kernels.moe import fused_moe_ref

    e = _quant_experts("nvfp4", 128, 2816, 704, seed=12, device="cuda")
    ref_w = e.quant_weights("gate_up_proj").dequantize(), e.quant_weights("down_proj").dequantize()
    gen = torch.Generator("cuda").manual_seed(13)
    for T in (1, 8, 32):
        x = torch.randn(T, 2816, device="cuda", generator=gen).to(torch.bfloat16)
        w, idx = torch.topk(torch.randn(T, 128, device="cuda", generator=gen).softmax(-1), 8)
        monkeypatch.setattr(quant.QuantizedExperts, "gather_kernels", True)
        y = e(x, idx, w)
        monkeypatch.setattr(quant.QuantizedExperts, "gather_kernels", False)
        err, vs_gemv = rel(y, fused_moe_ref(x.float(), *ref_w, w, idx)), rel(y, e(x, idx, w))
        print(f"T={T}: rel err {err:.2e}, vs the gemv gather {vs_gemv:.2e}")
        assert err < 1e-2 and vs_gemv < 1e-2
    monkeypatch.setattr(quant.QuantizedExperts, "gather_kernels", True)
    _assert_graph_replays_eager(lambda: e(x, idx, w))


@pytest.mark.parametrize("cls", ["Fp8Linear", "Nvfp4Linear"])
def test_merged_quantised_rows_equal_the_separate_gemms(cls):
    """q|k|v merged into one quantised linear: same outputs as the three modules (row for row, one GEMM), the
    modules' weights become views of the merged one, and a swapped module breaks `intact`."""
    import perfkit.runtime.quant as quant

    klass = getattr(quant, cls)
    torch.manual_seed(0)
    lins = [torch.nn.Linear(64, n, bias=False, device=DEVICE) for n in (48, 16, 32)]
    mods = [klass.from_linear(lin) for lin in lins]
    x = torch.randn(3, 64, device=DEVICE)
    want = torch.cat([m(x) for m in mods], dim=-1)
    merged = klass.merge_rows(mods)
    assert merged is not None and merged.weight.shape[0] == 96 and merged.intact(mods)
    assert mods[1].weight.data_ptr() == merged.weight[48:].data_ptr()
    torch.testing.assert_close(merged(x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([m(x) for m in mods], dim=-1), want)  # the views still compute the same
    assert not merged.intact([mods[0], klass.from_linear(lins[1]), mods[2]])
    assert klass.merge_rows([mods[0], torch.nn.Linear(64, 8, bias=False)]) is None


def test_nvfp4_linear_words_in_place_and_state_dicts():
    """Nvfp4Linear.set_words rewrites its weight in place in repack_words' order and back: outputs bit for bit at
    gemv, dot and dequant sizes, dequantized_weight unchanged; state_dict hands out the standard words (keep_vars the
    live buffer), load_state_dict of standard words stores them repacked; merged rows need one order and keep it; a
    backend that does not read repacked words stays standard."""
    import perfkit.runtime.quant as quant

    torch.manual_seed(0)
    lins = [torch.nn.Linear(64, n, bias=False) for n in (48, 16)]
    m = quant.Nvfp4Linear.from_linear(lins[0])
    std = m.weight.clone()
    xs = [torch.randn(M, 64) for M in (1, 24, 160)]
    want = [m(x) for x in xs]
    deq, ptr = m.dequantized_weight(), m.weight.data_ptr()
    assert m.set_words(True) and m.repacked and not m.set_words(True)
    assert m.weight.data_ptr() == ptr and torch.equal(m.weight, repack_words(std)) and "words=repacked" in repr(m)
    for x, w in zip(xs, want, strict=True):
        assert torch.equal(m(x), w)
    assert torch.equal(m.dequantized_weight(), deq) and torch.equal(m.standard_weight(), std)
    sd = m.state_dict()
    assert torch.equal(sd["weight"], std) and m.state_dict(keep_vars=True)["weight"] is m.weight
    other = quant.Nvfp4Linear.from_linear(torch.nn.Linear(64, 48, bias=False))
    other.set_words(True)
    other.load_state_dict(sd)  # the standard words of lins[0]: stored repacked
    assert torch.equal(other.weight, m.weight) and torch.equal(other(xs[0]), want[0])
    plain = quant.Nvfp4Linear.from_linear(lins[1])
    assert quant.Nvfp4Linear.merge_rows([m, plain]) is None  # two word orders
    plain.set_words(True)
    merged = quant.Nvfp4Linear.merge_rows([m, plain])
    assert merged is not None and merged.module.repacked
    assert torch.equal(merged(xs[0])[:, :48], want[0])
    assert m.set_words(False) and torch.equal(m.weight, std) and m.weight.data_ptr() == merged.weight.data_ptr()
    ref = quant.Nvfp4Linear.from_linear(lins[0])
    ref.backend = "w4a16-ref"
    assert not ref.set_words(True) and not ref.repacked and not ref.repack_pays()


def test_w4a16_repack_pays_one_wave_of_tc_programs(monkeypatch):
    """repack_pays: only where the batch-1 product runs the tensor-core gemv in one wave of programs (the H200's
    132 SMs: 5376 x 8192 at 6 splits, 504 programs, and 16384 x 5376 at 2, 512, pay; 18432 x 5376 at 3 splits, 864
    programs, and 43008 x 5376 do not; nor a CUDA-core shape, nor the CPU)."""
    import perfkit.kernels.w4a16_gemm as wk

    assert not wk.repack_pays(5376, 8192, "cpu")
    monkeypatch.setattr(wk, "interpreting", lambda: False)
    monkeypatch.setattr(wk, "tensor_cores_for_gemv", lambda device: True)
    monkeypatch.setattr(wk, "sm_count", lambda device: 132)
    pays = {(n, k): wk.repack_pays(n, k, "cuda") for n, k in
            ((5376, 8192), (5376, 16384), (5376, 21504), (16384, 5376), (18432, 5376), (43008, 5376), (4224, 2816))}  # fmt: skip
    assert pays == {(5376, 8192): True, (5376, 16384): True, (5376, 21504): True, (16384, 5376): True,
                    (18432, 5376): False, (43008, 5376): False, (4224, 2816): False}  # fmt: skip
    monkeypatch.setattr(wk, "tensor_cores_for_gemv", lambda device: False)
    assert not wk.repack_pays(5376, 8192, "cuda")
