"""FP8 weight-only GEMV (perfkit.kernels.fp8_gemv): the Triton kernel against its torch reference, split-K on and
off and its determinism, argument checks, the traffic formula, the tile validation, the sweep's flow and CLI, and
Fp8Linear's routing of decode rows; GPU tests (real 31B shapes, Fp8Linear on CUDA) skip without CUDA. On CPU the
kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported).

Tolerance (and why): kernel and reference multiply the same exact values (a bf16 / fp16 x times an e4m3 weight is
exact in fp32; fp32 x: one rounding per product) and differ only by fp32 rounding: the order of the K-term sums
(each within K * 2^-24 * sum |terms|), where the per-row scale is applied (the reference scales each weight, the
kernel each sum: one rounding each) and split-K's partial sums. Elementwise bound, as for W4A16 in test_quant.py:
``2 * (K + 4) * 2^-24 * sum_k |x_k * dequant(W)_nk| + ulp(out dtype) * |ref|`` (one ulp: rounding, or the
interpreter's truncation on the output cast). One-hot rows of x pick single weights: no accumulation to differ in,
so there the kernel equals the reference bit for bit.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("triton")

import perfkit.kernels.fp8_gemv as fg  # noqa: E402
import perfkit.kernels.w4a16_gemm as w4a16_gemm  # noqa: E402
import perfkit.runtime.quant as quant  # noqa: E402
from perfkit.kernels.fp8 import dequantize_fp8_rowwise, fp8_linear_ref, quantize_fp8_rowwise  # noqa: E402
from perfkit.kernels.fp8_gemv import (  # noqa: E402
    FP8_GEMV_MAX_M,
    GEMV_CONFIG,
    INTERPRETER_CONFIG,
    MAX_SPLIT_K,
    MIN_PROGRAMS_PER_SM,
    Fp8GemvConfig,
    fp8_gemv,
    fp8_gemv_ref,
    fp8_gemv_traffic,
)
from perfkit.kernels.launch import interpreting  # noqa: E402
from perfkit.runtime.quant import Fp8Linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # one ulp, relative (at most)
# Small tiles: N = 40 and K = 208 are multiples of neither block_n nor block_k (partial N tile, a K tail step).
TILE = Fp8GemvConfig(block_m=4, block_n=16, block_k=64, num_warps=4)
SPLIT_TILE = Fp8GemvConfig(block_m=4, block_n=16, block_k=32, num_warps=4, split_k=3)  # K = 208: 96 + 96 + 16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int = 0, device: str = DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8_rowwise(torch.randn(N, K, generator=gen) * 0.02)
    s = s * (0.5 + torch.rand(N, generator=gen))  # scales that are not amax / 448 exactly
    x = torch.randn(M, K, generator=gen).to(dtype)
    return x.to(device), q.to(device), s.to(device)


def _assert_close(out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """The elementwise bound of the module docstring (fp32 reference, sum of |terms| in float64)."""
    ref = fp8_gemv_ref(x, q, s, out_dtype=torch.float32).double()
    mag = x.double().abs() @ dequantize_fp8_rowwise(q, s).double().abs().T
    bound = 2 * (x.shape[1] + 4) * 2.0**-24 * mag + ULP[out.dtype] * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, bound there {bound[err == err.max()].min():.3g}"


# --------------------------------------------------------------------------------------------------------------
# Kernel vs reference (interpreter on CPU)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_matches_reference(M, dtype):
    """Decode sizes, partial N tiles and K tails: the small tile (N = 40 over 16-row tiles, K = 208 = 3 x 64 +
    16) and the default tile (one partial 64-row tile, 208 = 128 + 80); output in x's dtype."""
    x, q, s = _operands(M, 40, 208, dtype, seed=M)
    for cfg in (TILE, None):
        out = fp8_gemv(x, q, s, config=cfg)
        assert out.dtype == dtype and out.shape == (M, 40)
        _assert_close(out, x, q, s)


@pytest.mark.parametrize("K", [212, 300])
def test_k_tails_inside_a_group(K):
    """K % 8 != 0 (212: the last 8-element group has one valid word of two) and a K that is no multiple of the
    step either; M = 5 pads a 8-row tile with clamped rows; fp16 x."""
    x, q, s = _operands(5, 24, K, torch.float16, seed=K)
    for cfg in (TILE, Fp8GemvConfig(block_m=8, block_n=8, block_k=128, num_warps=4)):
        _assert_close(fp8_gemv(x, q, s, config=cfg), x, q, s)


TILE16 = Fp8GemvConfig(block_m=4, block_n=16, block_k=64, num_warps=4, group=16)  # 4 groups of 16 per step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_16_element_groups_match_reference(M, dtype):
    """group=16 (four words, one 16-byte load per thread and row): decode sizes, a partial N tile, K = 208 (a tail
    of one 16-group), K = 212 / 300 (the last group holding one / three valid words of four), split-K; within the
    reference's bound, and fp32 within twice of the 8-element form."""
    for K in (208, 212, 300):
        x, q, s = _operands(M, 40, K, dtype, seed=M + K)
        for cfg in (TILE16, Fp8GemvConfig(block_m=8, block_n=8, block_k=32, num_warps=4, split_k=3, group=16)):
            out = fp8_gemv(x, q, s, config=cfg)
            assert out.dtype == dtype and out.shape == (M, 40)
            _assert_close(out, x, q, s)
        if dtype == torch.float32:
            mag = x.double().abs() @ dequantize_fp8_rowwise(q, s).double().abs().T
            diff = (fp8_gemv(x, q, s, config=TILE16).double() - fp8_gemv(x, q, s, config=TILE).double()).abs()
            assert (diff <= 4 * (K + 4) * 2.0**-24 * mag + 1e-30).all()


def test_split_k_matches_and_is_deterministic():
    """Split-K (3 splits: fp32 partials summed in a fixed order by a second kernel) against the unsplit kernel
    and the reference, and bit-identical over two calls."""
    for M, dtype in ((1, torch.float32), (3, torch.bfloat16), (8, torch.float32)):
        x, q, s = _operands(M, 40, 208, dtype, seed=10 + M)
        split = fp8_gemv(x, q, s, config=SPLIT_TILE)
        whole = fp8_gemv(x, q, s, config=Fp8GemvConfig(block_m=4, block_n=16, block_k=32, num_warps=4, split_k=1))
        _assert_close(split, x, q, s)
        _assert_close(whole, x, q, s)
        assert torch.equal(split, fp8_gemv(x, q, s, config=SPLIT_TILE))  # fixed-order reduction: reproducible
        if dtype == torch.float32:  # both within the bound of the reference: within twice of each other
            mag = x.double().abs() @ dequantize_fp8_rowwise(q, s).double().abs().T
            assert ((split.double() - whole.double()).abs() <= 4 * (208 + 4) * 2.0**-24 * mag + 1e-30).all()


def test_split_k_rule():
    """Auto split-K only below MIN_PROGRAMS_PER_SM programs per SM (the CPU counts as one SM), at most MAX_SPLIT_K
    and the number of K steps, whole steps per split; a forced split_k is capped the same way."""
    cpu, cfg = torch.device("cpu"), Fp8GemvConfig(block_m=8, block_n=8, block_k=64, num_warps=4)
    assert fg._split_k(cfg, 64, cpu, programs=MIN_PROGRAMS_PER_SM, K=4096) == (1, 4096)
    assert fg._split_k(cfg, 64, cpu, programs=1, K=4096) == (MIN_PROGRAMS_PER_SM, 2048)
    assert fg._split_k(cfg, 64, cpu, programs=1, K=64) == (1, 64)  # one step: nothing to split
    forced = Fp8GemvConfig(block_m=8, block_n=8, block_k=32, num_warps=4, split_k=3)
    assert fg._split_k(forced, 32, cpu, programs=1000, K=208) == (3, 96)  # 7 steps: 3 + 3 + 1
    huge = Fp8GemvConfig(block_m=8, block_n=8, block_k=64, num_warps=4, split_k=100)
    assert fg._split_k(huge, 64, cpu, programs=1, K=64 * 100)[0] == MAX_SPLIT_K


def _onehot_case(K: int, device: str):
    """16 weight rows, each holding all 254 non-NaN e4m3 bytes (0x7F / 0xFF are NaN) and zeros, in a different
    order; scales from tiny to large; one-hot rows of x whose columns cover every byte of a word and of a group."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    rows = []
    for _ in range(16):
        row = codes.repeat(K // 254 + 1)[:K]
        rows.append(row[torch.randperm(K, generator=gen)])
    q = torch.stack(rows).view(torch.float8_e4m3fn)
    s = torch.tensor([2.0**-20, 1e-3, 1.0, 3.7e4] * 4) * (1 + torch.rand(16, generator=gen))
    cols = (torch.arange(16) * (K // 16 + 1)) % K  # K // 16 + 1 odd for these K: all positions mod 8
    return cols, q.to(device), s.to(device)


def test_onehot_rows_are_exact():
    """One-hot rows of x pick single weights: kernel == reference bit for bit (fp32 x and output) over every
    non-NaN byte value in every byte position; bf16 x within one bf16 ulp (the interpreter truncates on the output
    cast; the GPU test holds bf16 to bit-exactness too)."""
    K = 256
    cols, q, s = _onehot_case(K, DEVICE)
    x = torch.zeros(16, K, device=DEVICE)
    x[torch.arange(16), cols] = 1.0
    cfg = Fp8GemvConfig(block_m=8, block_n=16, block_k=64, num_warps=4)
    assert torch.equal(fp8_gemv(x, q, s, config=cfg), fp8_gemv_ref(x, q, s))
    assert torch.equal(fp8_gemv(x, q, s, config=dataclasses.replace(cfg, group=16)), fp8_gemv_ref(x, q, s))
    xb = x.to(torch.bfloat16)
    want = fp8_gemv_ref(xb, q, s, out_dtype=torch.float32)
    err = (fp8_gemv(xb, q, s, config=cfg).float() - want).abs()
    assert (err <= 2.0**-7 * want.abs()).all()


TC = Fp8GemvConfig(block_m=1, block_n=64, block_k=64, num_warps=4, num_stages=3, tc=True)


def test_tc_gemv_matches_reference_and_each_row_is_its_own_launch():
    """The tensor-core gemv on e4m3 words (``tc``: the W4A16 kernel's loop, ``_tc_e4m3_tile``): within the bound of the
    reference at M 1-16 (row m of x in the MMA's column m) and 40 (three programs per row block, 16 rows of x each, or
    two of 32 with ``tc_cols`` 32), rows past N, a ragged last K step (masked), one and several splits summed in the
    launch (the counter back at zero) or by a second launch; each output row equals that row's M = 1 launch bit for bit
    (the MMA's columns are summed apart)."""
    from perfkit.kernels.w4a16_gemm import new_split_counter

    cases = ((1, 80, 256, 64, None, 16), (2, 80, 512, 128, 1, 16), (16, 40, 1088, 128, 3, 16),
             (7, 80, 320, 64, 5, 16), (40, 80, 256, 64, 3, 16), (40, 80, 256, 64, 3, 32))  # fmt: skip
    for M, N, K, bk, split, cols in cases:
        x, q, s = _operands(M, N, K, torch.bfloat16, seed=40 + M)
        cfg = dataclasses.replace(TC, block_k=bk, split_k=split, tc_cols=cols)
        counter = new_split_counter(N, DEVICE)
        out = fp8_gemv(x, q, s, config=cfg, split_counter=counter, out_dtype=torch.float32)
        _assert_close(out, x, q, s)
        assert not counter.any()
        rows = torch.cat([fp8_gemv(x[i : i + 1], q, s, config=cfg, out_dtype=torch.float32) for i in range(M)])
        assert torch.equal(out, rows)
        assert fp8_gemv(x, q, s, config=cfg).dtype == torch.bfloat16


def test_tc_gemv_decode_and_k_order_are_exact():
    """One-hot rows of x through the tensor-core gemv: every non-NaN byte value in every byte position, each output
    one exact e4m3 value times its row's scale, rounded once: equal to the reference bit for bit (fp32 output), which
    holds only if the decoded pair and the gathered x element name the same K position; 1 and 2 splits."""
    K = 256
    cols, q, s = _onehot_case(K, DEVICE)
    x = torch.zeros(16, K, device=DEVICE, dtype=torch.bfloat16)
    x[torch.arange(16), cols] = 1.0
    want = fp8_gemv_ref(x, q, s, out_dtype=torch.float32)
    for split in (1, 2):
        got = fp8_gemv(x, q, s, config=dataclasses.replace(TC, split_k=split), out_dtype=torch.float32)
        assert torch.equal(got, want)


def test_tc_gemv_config_rules(monkeypatch):
    """pick_config on a (faked) sm_90 GPU: the tensor-core tile for 2..GEMV_TC_MAX_M rows of bf16 x with K of whole
    64-wide steps (256-wide up to GEMV_TC_WIDE_STEP_MAX_M rows, then 128-wide, above 16 rows 32 rows of x per
    program; halved until the step divides K), at M =
    1 only for wide (N >= K) or large (GEMV_TC_M1_MIN_ELEMENTS) products, above 16 rows only for large ones
    (GEMV_TC_GROUPS_MIN_ELEMENTS), the CUDA-core tile at M = 1 otherwise, None (the W8A8 path) beyond; without tensor
    cores one row. A tc tile the kernel cannot take (fp16 x, more than 4 groups of 16 rows) runs the CUDA-core default
    with the same result; bad tc tiles are refused."""
    monkeypatch.setattr(fg, "tensor_cores_for_gemv", lambda device: True)
    monkeypatch.setattr(fg, "interpreting", lambda: False)
    bf, half = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.float16)
    wide, rows = fg.GEMV_TC_CONFIG, fg.GEMV_TC_ROWS_CONFIG
    assert fg.pick_config(fg.GEMV_TC_WIDE_STEP_MAX_M, 5376, 8192, bf) is wide
    assert fg.pick_config(fg.GEMV_TC_WIDE_STEP_MAX_M + 1, 5376, 8192, bf) is rows
    assert fg.pick_config(16, 5376, 8192, bf) is rows
    assert fg.pick_config(1, 43008, 5376, bf) is wide and fg.pick_config(1, 5376, 21504, bf) is wide  # H200 12-18
    assert fg.pick_config(1, 5376, 8192, bf) is GEMV_CONFIG and fg.pick_config(1, 5376, 16384, bf) is GEMV_CONFIG
    assert fg.pick_config(4, 2816, 2112, bf) == dataclasses.replace(wide, block_k=64)  # 26B-A4B down
    assert fg.pick_config(2, 4224, 2816 + 128, bf) == dataclasses.replace(wide, block_k=128)
    assert fg.pick_config(fg.GEMV_TC_MAX_M + 1, 5376, 5376, bf) is None
    cols = fg.GEMV_TC_COLS_CONFIG  # above 16 rows: 32 rows of x per program
    assert fg.pick_config(17, 5376, 8192, bf) is cols and fg.pick_config(17, 2816, 8192, bf) is None  # 44 M / 23 M
    assert fg.pick_config(32, 5376, 8192, bf) is cols
    assert fg.pick_config(2, 5376, 5376 + 16, bf) is None and fg.pick_config(1, 5376, 5376 + 16, bf) is GEMV_CONFIG
    assert fg.pick_config(2, 5376, 5376, half) is None and fg.pick_config(1, 5376, 5376, half) is GEMV_CONFIG
    assert fg.gemv_max_m(torch.bfloat16, "cuda") == fg.GEMV_TC_MAX_M and fg.gemv_max_m(torch.float16, "cuda") == 1
    monkeypatch.setattr(fg, "tensor_cores_for_gemv", lambda device: False)
    assert fg.pick_config(1, 5376, 5376, bf) is GEMV_CONFIG and fg.pick_config(2, 5376, 5376, bf) is None
    monkeypatch.undo()
    from perfkit.kernels.w4a16_gemm import GEMV_TC_MAX_ROW_GROUPS

    for M, dtype in ((16 * GEMV_TC_MAX_ROW_GROUPS + 1, torch.bfloat16), (3, torch.float16)):
        x, q, s = _operands(M, 24, 128, dtype, seed=M)
        assert torch.equal(fp8_gemv(x, q, s, config=TC), fp8_gemv(x, q, s))
    for bad in ({"block_n": 8}, {"block_k": 32}, {"tc_cols": 64}):
        with pytest.raises(ValueError, match="tc: block_n >= 16"):
            dataclasses.replace(TC, **bad)


def test_strided_inputs_views_and_edge_cases():
    x, q, s = _operands(6, 40, 208, torch.bfloat16, seed=5)
    wide = torch.zeros(6, 300, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 16:224] = x
    _assert_close(fp8_gemv(wide[:, 16:224], q, s, config=TILE), x, q, s)  # row stride 300
    _assert_close(fp8_gemv(x[::2], q, s, config=TILE), x[::2], q, s)  # every other row
    xt = x.t().contiguous().t()  # K stride != 1: copied
    _assert_close(fp8_gemv(xt, q, s, config=TILE), x, q, s)
    _assert_close(fp8_gemv(x, q[8:], s[8:], config=TILE), x, q[8:], s[8:])  # a row slice (merged q|k|v views)
    empty = fp8_gemv(x[:0], q, s)
    assert empty.shape == (0, 40) and empty.dtype == torch.bfloat16
    assert fp8_gemv(x, q[:0], s[:0]).shape == (6, 0)


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, q, s: (x[0], q, s),  # 1-D x
        lambda x, q, s: (x.to(torch.int32), q, s),  # integer x
        lambda x, q, s: (x.double(), q, s),  # fp64 x
        lambda x, q, s: (x, q.view(torch.uint8), s),  # not e4m3
        lambda x, q, s: (x, q.float(), s),
        lambda x, q, s: (x[:, :200], q, s),  # K mismatch
        lambda x, q, s: (x, q[None], s),  # 3-D weight
        lambda x, q, s: (x, q, s[:-1]),  # scale length
        lambda x, q, s: (x, q, s.to(torch.bfloat16)),  # scale dtype
        lambda x, q, s: (x, q, s[:, None]),  # scale shape
        lambda x, q, s: (x[:, :206], q[:, :206], s),  # K % 4 != 0
        lambda x, q, s: (x[:, :40], q[:, :40].t(), s[:40]),  # transposed weight (K stride != 1)
    ],
)
def test_bad_arguments_raise(bad):
    x, q, s = _operands(2, 40, 208, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError):
        fp8_gemv(*bad(x, q, s))


def test_bad_config_type_raises():
    x, q, s = _operands(2, 40, 208, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="Fp8GemvConfig"):
        fp8_gemv(x, q, s, config={"block_n": 16})


# --------------------------------------------------------------------------------------------------------------
# Config, traffic, sweep
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_n": 24},
        {"block_m": 3},
        {"block_k": 8},
        {"block_k": 96},
        {"num_warps": 3},
        {"num_stages": 0},
        {"split_k": 0},
        {"block_n": 0},
        {"group": 4},
        {"group": 32},
    ],
)
def test_config_validation(kwargs):
    base = {"block_m": 8, "block_n": 8, "block_k": 1024, "num_warps": 4}
    with pytest.raises(ValueError, match="powers of two"):
        Fp8GemvConfig(**{**base, **kwargs})


def test_default_configs():
    assert Fp8GemvConfig(block_m=1, block_n=1, block_k=16, num_warps=1, split_k=1).split_k == 1
    for cfg in (GEMV_CONFIG, INTERPRETER_CONFIG, *[c for c in fg.SWEEP_CONFIGS if c is not None]):
        assert isinstance(cfg, Fp8GemvConfig)
    assert GEMV_CONFIG.block_k % (32 * GEMV_CONFIG.group * GEMV_CONFIG.num_warps) == 0  # x in the weight's layout
    assert GEMV_CONFIG.block_m >= FP8_GEMV_MAX_M  # every routed M in one row tile: the weight streamed once
    assert fg.default_config() is (INTERPRETER_CONFIG if interpreting() else GEMV_CONFIG)
    assert fg._fit(GEMV_CONFIG, 1, 5376, 21504) == (1, GEMV_CONFIG.block_n, GEMV_CONFIG.block_k)
    assert fg._fit(GEMV_CONFIG, 3, 5, 20) == (min(GEMV_CONFIG.block_m, 4), min(GEMV_CONFIG.block_n, 8), 32)  # clipped
    assert 1 <= len(fg.SWEEP_CONFIGS) <= 18 and len(set(fg.SWEEP_CONFIGS)) == len(fg.SWEEP_CONFIGS)
    assert {fg.GEMV_TC_CONFIG, fg.GEMV_TC_ROWS_CONFIG} <= set(fg.SWEEP_CONFIGS)


def test_traffic():
    t = fp8_gemv_traffic(4, 5376, 21504)
    weight = 5376 * 21504 + 4 * 5376
    assert t["weight_bytes"] == weight
    assert t["bytes_read"] == weight + 4 * 21504 * 2
    assert t["bytes_written"] == 4 * 5376 * 2
    assert t["total_bytes"] == weight + 4 * 21504 * 2 + 4 * 5376 * 2
    assert t["flops"] == 2 * 4 * 5376 * 21504
    assert t["bound_ms"] == pytest.approx(t["total_bytes"] / 4.3e12 * 1e3)
    t32 = fp8_gemv_traffic(1, 16, 32, act_bytes=4, out_bytes=4)
    assert t32["total_bytes"] == 16 * 32 + 64 + 32 * 4 + 16 * 4


def test_sweep_summary():
    """Best tile per (shape, M), the tile with the best geomean time-vs-best per M, and max_m: the largest M up to
    which the best tile beats scaled_mm at every shape."""
    a, b = {"block_n": 8}, {"block_n": 16}

    def row(M, K, cfg, ms, mm):
        return {"M": M, "N": 8, "K": K, "config": cfg, "median_ms": ms, "pct_of_bound": 50.0,
                "speedup_vs_bf16": 1.0, "speedup_vs_scaled_mm": mm / ms}  # fmt: skip

    rows = [
        row(1, 16, a, 1.0, 3.0), row(1, 16, b, 2.0, 3.0), row(1, 32, a, 4.0, 3.0), row(1, 32, b, 1.0, 3.0),
        row(4, 16, a, 1.0, 0.5), row(4, 32, a, 1.0, 3.0),
        {"M": 4, "N": 8, "K": 16, "config": b, "error": "OutOfResources"},
    ]  # fmt: skip
    summary = fg._sweep_summary(rows)
    best = {(d["K"], d["M"]): d["config"] for d in summary if d["summary"] == "best_config"}
    assert best == {(16, 1): a, (32, 1): b, (16, 4): a, (32, 4): a}
    per_m = {d["M"]: d for d in summary if d["summary"] == "best_config_per_m"}
    assert per_m[1]["config"] == b and per_m[1]["geomean_time_vs_best"] == pytest.approx(2**0.5, abs=1e-3)
    assert [d["max_m"] for d in summary if d["summary"] == "max_m"] == [1]  # M = 4 loses at K = 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the sweep's CPU flow (interpreter); a GPU runs the real one")
def test_sweep_runs_end_to_end_on_cpu(monkeypatch, tmp_path):
    """The GPU sweep's flow at a toy shape with the timer stubbed: one JSONL row per (shape, M, tile) with the
    bench keys and a correct result, a failing tile recorded as an error, then the summary rows and a table."""
    import perfkit.kernels.stream as stream

    monkeypatch.setattr(fg, "graph_ms", lambda fn, warmup=0, rep=0: (fn(), 1.0)[1])
    monkeypatch.setattr(stream, "graph_ms", lambda fn, warmup=0, rep=0: (fn(), 0.5)[1])

    def flaky(x, q, s, config=None):  # the 32-row tile "fails to compile"
        if config.block_n == 32:
            raise RuntimeError("boom")
        return fp8_gemv(x, q, s, config)

    monkeypatch.setattr(fg, "fp8_gemv", flaky)
    log: list[str] = []
    out = tmp_path / "sweep.jsonl"
    cfgs = (None, TILE, Fp8GemvConfig(block_m=8, block_n=32, block_k=64, num_warps=4))
    results = fg.sweep_fp8_gemv(shapes=[(40, 64)], ms=(1, 3), configs=cfgs, log=log.append, out=str(out), device="cpu")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == json.loads(json.dumps(results))
    timed = [r for r in rows if "median_ms" in r and "summary" not in r]
    assert len(timed) == 4 and all(r["rel_err_vs_ref"] < 1e-2 for r in timed)
    keys = {"median_ms", "bound_ms", "pct_of_bound", "achieved_tb_s", "speedup_vs_bf16", "speedup_vs_scaled_mm",
            "bf16_cublas_ms", "fp8_scaled_mm_ms", "rel_err_vs_ref", "config", "splits", "stream_ms",
            "pct_of_stream"}  # fmt: skip
    assert keys <= set(timed[0]) and timed[0]["fp8_scaled_mm_ms"] is None  # no scaled_mm on CPU
    assert timed[0]["pct_of_stream"] == pytest.approx(50.0)  # the probe's 0.5 ms over the kernel's 1 ms
    assert [r["config"]["block_n"] for r in rows if "error" in r] == [32, 32]
    assert {r["summary"] for r in rows if "summary" in r} == {"best_config", "best_config_per_m", "max_m", "wall_s"}
    assert any("best tile" in line for line in log)


def test_main_without_cuda_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fg._main(["--sweep"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "CUDA" in out[0]
    assert fg._main([]) == 0  # no --sweep: the help


# --------------------------------------------------------------------------------------------------------------
# Fp8Linear routing
# --------------------------------------------------------------------------------------------------------------


def test_fp8_linear_routes_decode_rows_to_the_gemv(monkeypatch):
    """Backend fp8-scaled-mm (forced on CPU): flattened M <= FP8_GEMV_MAX_M calls fp8_gemv (weight-only
    numerics), larger M the W8A8 fp8_linear (stubbed: scaled_mm needs a GPU), quantize_input=False at large M the
    torch reference. With tensor cores (faked) M up to GEMV_TC_MAX_M of bf16 x take the tensor-core gemv, with the
    module's split counter."""
    calls: list[tuple[str, tuple[int, ...]]] = []

    def gemv(x, w, s, config, pdl, split_counter):
        calls.append(("gemv", tuple(x.shape)))
        assert pdl is False  # the model's pdl flag (set_pdl), off here
        assert (split_counter is not None) == config.tc
        return fp8_gemv(x, w, s, config=config, split_counter=split_counter)

    def w8a8(x, w, s):
        calls.append(("scaled_mm", tuple(x.shape)))
        return fp8_linear_ref(x, w, s)

    monkeypatch.setattr(quant, "fp8_gemv", gemv)
    monkeypatch.setattr(quant, "fp8_linear", w8a8)
    lin = torch.nn.Linear(64, 24, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.02)
    m = Fp8Linear.from_linear(lin)
    m.backend = "fp8-scaled-mm"
    x = torch.randn(FP8_GEMV_MAX_M, 1, 64)  # flattened: M = FP8_GEMV_MAX_M rows
    y = m(x)
    assert calls == [("gemv", (FP8_GEMV_MAX_M, 64))] and y.shape == (FP8_GEMV_MAX_M, 1, 24)
    torch.testing.assert_close(y, x @ m.dequantized_weight().T, atol=1e-5, rtol=1e-5)  # x not quantised
    calls.clear()
    m(torch.randn(FP8_GEMV_MAX_M + 1, 64))
    assert calls == [("scaled_mm", (FP8_GEMV_MAX_M + 1, 64))]
    calls.clear()
    m.quantize_input = False
    m(torch.randn(FP8_GEMV_MAX_M + 1, 64))
    assert calls == []
    m.backend = "fp8-ref"
    m(torch.randn(1, 64))
    assert calls == []
    m.backend, m.quantize_input = "fp8-scaled-mm", True
    monkeypatch.setattr(fg, "tensor_cores_for_gemv", lambda device: True)
    monkeypatch.setattr(fg, "interpreting", lambda: False)  # pick_config's GPU rules; the kernels still interpret
    monkeypatch.setattr(w4a16_gemm, "GEMV_TC_GROUPS_MIN_ELEMENTS", 0)  # this toy weight counts as large
    for M in (1, fg.GEMV_TC_MAX_M, fg.GEMV_TC_MAX_M + 1):
        calls.clear()
        x = torch.randn(M, 64).to(torch.bfloat16)
        y = m(x)
        assert calls == [("gemv" if M <= fg.GEMV_TC_MAX_M else "scaled_mm", (M, 64))]
        if M <= fg.GEMV_TC_MAX_M:
            _assert_close(y, x, m.weight, m.weight_scale)
    assert m._split_counter is not None and not m._split_counter.any()


def test_fp8_model_runs_decode_rows_on_the_tensor_core_gemv(monkeypatch):
    """A tiny bf16 model with FP8 weights, backend fp8-scaled-mm and a (faked) sm_90 GPU's rules: forwards of 1, 7
    and 20 tokens run every FP8 linear at M > 1 on the tensor-core gemv (20: two 16-row groups), at M = 1 where
    pick_config gives it; every linear's output (q / k / v and gate / up views of the merged rows included) is the
    weight-only torch reference's within one bf16 ulp (the interpreter truncates the output cast where the GPU
    rounds), and each module's counter is back at zero. Per linear, not on the logits: a random tiny model in bf16
    turns one ulp per linear into several % of its logits."""
    from perfkit.kernels.fp8 import fp8_linear_ref
    from perfkit.runtime.attention.contiguous import ContiguousAttention
    from perfkit.runtime.model_config import get_preset
    from perfkit.runtime.weights import build_model

    monkeypatch.setattr(fg, "tensor_cores_for_gemv", lambda device: True)
    monkeypatch.setattr(fg, "interpreting", lambda: False)
    monkeypatch.setattr(w4a16_gemm, "GEMV_TC_GROUPS_MIN_ELEMENTS", 0)
    model = build_model(get_preset("tiny"), "cpu", torch.bfloat16, seed=0)
    quant.quantize_model_(model, "fp8")
    lins = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    errs: list[float] = []

    def check(mod, args, out):
        x2 = args[0].reshape(-1, mod.in_features)
        ref = fp8_linear_ref(x2, mod.weight, mod.weight_scale, quantize_input=False).float()
        errs.append(((out.reshape(ref.shape).float() - ref).abs() / (ref.abs() + 1e-3)).max().item())

    for m in lins:
        m.backend, m.quantize_input = "fp8-scaled-mm", False
        m.register_forward_hook(check)
    tiles: list[bool] = []
    real = quant.fp8_gemv
    monkeypatch.setattr(quant, "fp8_gemv", lambda *a, **kw: (tiles.append(kw["config"].tc), real(*a, **kw))[1])
    ids = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(2))
    for T in (1, 7, 20):
        tiles.clear()
        errs.clear()
        attn = ContiguousAttention()
        attn.prepare(T, torch.zeros_like(ids[:T]))
        with torch.no_grad():
            model(ids[:T], torch.arange(T), attn)
        assert len(tiles) == len(errs) > 0 and (all(tiles) if T > 1 else any(tiles))
        assert max(errs) <= 2.0**-7, (T, max(errs))
    assert all(m._split_counter is not None and not m._split_counter.any() for m in lins)


# --------------------------------------------------------------------------------------------------------------
# GPU (H200): real 31B shapes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("N,K", [(5376, 21504), (21504, 5376)])
def test_gpu_real_shapes_match_reference(M, N, K):
    """The GPU-only code of the CUDA-core kernel (inline-PTX e4m3 conversion, the default tile's layout) at the
    31B's down and q|k|v shapes: within the bound of the reference; forced split-K bit-reproducible and within the
    bound too."""
    x, q, s = _operands(M, N, K, torch.bfloat16, seed=M, device="cuda")
    _assert_close(fp8_gemv(x, q, s, config=GEMV_CONFIG), x, q, s)
    cfg = Fp8GemvConfig(block_m=8, block_n=8, block_k=1024, num_warps=4, split_k=4)
    a = fp8_gemv(x, q, s, config=cfg)
    assert torch.equal(a, fp8_gemv(x, q, s, config=cfg))
    _assert_close(a, x, q, s)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [(5376, 21504), (43008, 5376), (5376, 8192), (2816, 2112)])
def test_gpu_tc_gemv_real_shapes_rows_and_graph(N, K):
    """The tensor-core gemv on e4m3 words (the GPU's PTX decode: prmt + bf16x2 multiply) at 31B shapes and the
    26B-A4B's down (64-wide steps): M 1, 3 and 16 (the tile of M >= 2) within the reference's bound with the splits
    summed in the launch, each row equal to its M = 1 launch bit for bit, and a CUDA graph of the launch replayed on
    new x equal to the eager result, the counter back at zero."""
    from perfkit.kernels.w4a16_gemm import new_split_counter

    for M in (1, 3, 16):
        x, q, s = _operands(M, N, K, torch.bfloat16, seed=M + N, device="cuda")
        cfg = fg.pick_config(max(M, 2), N, K, x)  # M = 1 runs the same tile here (pick_config may not at M = 1)
        assert cfg is not None and cfg.tc
        counter = new_split_counter(N, "cuda")
        out = fp8_gemv(x, q, s, config=cfg, split_counter=counter, out_dtype=torch.float32)
        _assert_close(out, x, q, s)
        rows = torch.cat([fp8_gemv(x[i : i + 1], q, s, config=cfg, out_dtype=torch.float32) for i in range(M)])
        assert torch.equal(out, rows)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = fp8_gemv(x, q, s, config=cfg, split_counter=counter)
        x.copy_(torch.randn_like(x))
        g.replay()
        assert torch.equal(y, fp8_gemv(x, q, s, config=cfg, split_counter=counter)) and not counter.any()


@pytest.mark.gpu
@gpu
def test_gpu_onehot_exact_with_the_default_tile():
    """Every non-NaN e4m3 byte through the inline-PTX conversion and the default tile (full steps and a tail):
    bit-exact against the reference."""
    K = 2048 + 256
    cols, q, s = _onehot_case(K, "cuda")
    x = torch.zeros(16, K, dtype=torch.float32, device="cuda")
    x[torch.arange(16), cols] = 1.0
    assert torch.equal(fp8_gemv(x, q, s), fp8_gemv_ref(x, q, s))
    assert torch.equal(fp8_gemv(x.bfloat16(), q, s), fp8_gemv_ref(x.bfloat16(), q, s))


@pytest.mark.gpu
@gpu
def test_gpu_fp8_linear_gemv_and_scaled_mm(monkeypatch):
    """Fp8Linear on CUDA: M = 1 and 4 (the tensor-core rows on sm_90+) go through fp8_gemv, M = 64 through scaled_mm;
    both close to the bf16 linear holding the dequantised weight (gemv: bf16 rounding only; W8A8 adds ~2.5 %
    per-token activation rounding)."""
    calls: list[str] = []
    real_gemv, real_mm = quant.fp8_gemv, quant.fp8_linear
    monkeypatch.setattr(quant, "fp8_gemv", lambda *a, **kw: (calls.append("gemv"), real_gemv(*a, **kw))[1])
    monkeypatch.setattr(quant, "fp8_linear", lambda *a: (calls.append("scaled_mm"), real_mm(*a))[1])
    lin = torch.nn.Linear(5376, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02)
    m = Fp8Linear.from_linear(lin)
    assert m.backend == "fp8-scaled-mm"
    w = m.dequantized_weight().to(torch.bfloat16)
    four = "gemv" if fg.gemv_max_m(torch.bfloat16, "cuda") >= 4 else "scaled_mm"
    for M, path, tol in ((1, "gemv", 1e-2), (4, four, 1e-2 if four == "gemv" else 5e-2), (64, "scaled_mm", 5e-2)):
        calls.clear()
        x = torch.randn(M, 5376, device="cuda", dtype=torch.bfloat16)
        y = m(x)
        want = (x.float() @ w.float().T).to(torch.bfloat16)
        err = ((y.float() - want.float()).norm() / want.float().norm()).item()
        assert calls == [path] and y.dtype == torch.bfloat16 and err < tol, (M, calls, err)


def test_result_records_the_fp8_decode_gemv_rule():
    """runtime.quant says which rows took the weight-only GEMV (fp8-scaled-mm only: fp8-ref runs the reference)."""
    from perfkit.runners.serving import _quant_info
    from perfkit.runtime.quant import QuantReport

    def report(backend):
        return QuantReport("fp8", backend, None, 4, 2, 8, 6, 1, 0)

    cpu = _quant_info(report("fp8-scaled-mm"), torch.bfloat16, "cpu")
    assert cpu["fp8_gemv_max_m"] == FP8_GEMV_MAX_M  # no tensor cores: one row (the CUDA-core gemv)
    assert "fp8_gemv_max_m" not in _quant_info(report("fp8-ref"), torch.bfloat16, "cpu")


@pytest.mark.gpu
@gpu
def test_gpu_bench_reports_the_chain():
    """bench_fp8_gemv at a 31B decode shape: exact to the reference's rounding, one-launch and chained timings, the
    chained % against the chained load-only read of the same bytes."""
    r = fg.bench_fp8_gemv(1, 5376, 8192)
    print(r)
    assert r["rel_err_vs_ref"] < 1e-2
    assert r["chain_us"] > 0 and r["stream_chain_us"] > 0
    assert r["chain_pct_of_stream"] == pytest.approx(100 * r["stream_chain_us"] / r["chain_us"])
