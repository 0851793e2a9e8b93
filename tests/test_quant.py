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
    E2M1_VALUES,
    W4A16Config,
    dequantize_nvfp4,
    quantize_nvfp4,
    unpack_e2m1,
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

SMALL = W4A16Config(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)
SPLIT = W4A16Config(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1, split_k=3)


def _operands(M, N, K, dtype, seed=0, per_row_gs=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.02
    q, s, gs = quantize_nvfp4(w)
    if per_row_gs:
        gs = gs * (0.5 + torch.rand(N, generator=gen))
    x = torch.randn(M, K, generator=gen).to(dtype)
    return x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), gs.to(DEVICE)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("N,K", [(48, 64), (33, 256), (100, 160), (64, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_matches_reference(M, N, K, dtype):
    x, q, s, gs = _operands(M, N, K, dtype)
    ref = w4a16_gemm_ref(x, q, s, gs, out_dtype=torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 0  # fp32 output: accumulation order only
    for cfg in (None, SMALL, SPLIT):
        out = w4a16_gemm(x, q, s, gs, config=cfg)
        assert out.dtype == dtype and out.shape == (M, N)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=1e-5)
        else:  # one bf16 rounding of the output (the CPU interpreter truncates: up to one ulp)
            torch.testing.assert_close(out.float(), ref, atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("scale_mode", ["reshape", "gather"])
def test_w4a16_scale_modes_per_row_global_scale_and_fp32_out(scale_mode):
    x, q, s, gs = _operands(5, 72, 96, torch.bfloat16, seed=3, per_row_gs=True)
    ref = w4a16_gemm_ref(x, q, s, gs, out_dtype=torch.float32)
    for cfg in (SMALL, SPLIT, None):
        out = w4a16_gemm(x, q, s, gs, out_dtype=torch.float32, config=cfg, scale_mode=scale_mode)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_w4a16_strided_input_and_edge_cases():
    x, q, s, gs = _operands(6, 40, 64, torch.float32, seed=4)
    xt = torch.randn(64, 6, device=DEVICE).T  # non-contiguous [6, 64]
    torch.testing.assert_close(w4a16_gemm(xt, q, s, gs), w4a16_gemm_ref(xt, q, s, gs), atol=1e-6, rtol=1e-5)
    assert w4a16_gemm(x[:0], q, s, gs).shape == (0, 40)
    with pytest.raises(ValueError, match="K % 16"):
        w4a16_gemm(torch.randn(2, 72, device=DEVICE), q, s, gs)
    with pytest.raises(ValueError, match="scale_mode"):
        w4a16_gemm(x, q, s, gs, scale_mode="lut")


def test_w4a16_prefill_shape():
    x, q, s, gs = _operands(130, 48, 128, torch.float32, seed=5)
    torch.testing.assert_close(w4a16_gemm(x, q, s, gs), w4a16_gemm_ref(x, q, s, gs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_row_gs", [False, True])
def test_w4a16_gathered_matches_reference(per_row_gs):
    gen = torch.Generator().manual_seed(6)
    E, N, K, R = 5, 40, 96, 7
    q, s, gs = quantize_nvfp4(torch.randn(E, N, K, generator=gen) * 0.02)
    if per_row_gs:
        gs = gs[:, None] * (0.5 + torch.rand(E, N, generator=gen))
    ids = torch.tensor([4, 0, 4, 2, 1, 1, 3])
    x = torch.randn(R, K, generator=gen)
    q, s, gs, ids, x = (t.to(DEVICE) for t in (q, s, gs, ids, x))
    out = w4a16_gemm_gathered(x, q, s, gs, ids)
    ref = w4a16_gemm_gathered_ref(x, q, s, gs, ids)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for r in range(R):  # row r == plain GEMM against expert ids[r]
        e = int(ids[r])
        torch.testing.assert_close(
            out[r : r + 1], w4a16_gemm_ref(x[r : r + 1], q[e], s[e], gs[e]), atol=1e-6, rtol=1e-5
        )


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
        for n in (300, 1):  # prefill-shaped (M=300) and decode-shaped (M=1) GEMMs
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
@pytest.mark.parametrize("M,N,K", [(1, 5376, 21504), (1, 21504, 5376), (4, 8192, 5376), (16, 5376, 8192)])
def test_gpu_w4a16_real_shapes_and_timing(M, N, K):
    from perfkit.kernels.w4a16_gemm import bench_w4a16

    r = bench_w4a16(M, N, K)
    print(r)
    assert r["rel_err_vs_ref"] < 1e-2
