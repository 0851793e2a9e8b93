"""Roofline arithmetic against hand computations from the spec numbers (shared/reference/gemma4.md §1, §2.7).

Every expected value below is written out from the architecture table, not from perfkit code."""

from __future__ import annotations

import pytest

from perfkit.results import RooflineSection
from perfkit.roofline import (
    MEASURED_H200,
    attention_pairs,
    bound_ms,
    decode_kv_read_bytes,
    decode_step_bytes,
    decode_step_flops,
    expected_active_experts,
    get_gpu_peak,
    kv_cache_bytes_per_token,
    match_gpu,
    mbu,
    mfu,
    prefill_flops,
    roofline_section,
    serving_bound,
    step_weight_params,
)
from perfkit.runtime.model_config import get_preset, param_count

V = 262144
KIB = 1024

# ---- 31B by hand: H 5376, 60 layers = 50 sliding + 10 full, 32 heads; sliding kvh 16 hd 256; full kvh 4 hd 512 (K=V)
H31 = 5376
ATTN_S_31 = (2 * 32 * 256 + 2 * 16 * 256) * H31  # q + o, k + v
ATTN_F_31 = (2 * 32 * 512 + 4 * 512) * H31  # q + o, k only (K=V)
MLP_31 = 3 * 21504 * H31
LINEAR_31 = 50 * (ATTN_S_31 + MLP_31) + 10 * (ATTN_F_31 + MLP_31)
NORMS_31 = 50 * (4 * H31 + 1 + 256 + 256) + 10 * (4 * H31 + 1 + 512 + 512) + H31  # 4 norms+scalar, q/k norm; final
LM_HEAD_31 = V * H31

# ---- 26B-A4B by hand: H 2816, 30 layers = 25 S + 5 F, 16 heads; S kvh 8 hd 256; F kvh 2 hd 512 (K=V);
# dense MLP 2112; MoE 128 experts top-8, expert width 704; router proj [128, H] + scale [H] + per-expert [128]
H26 = 2816
ATTN_S_26 = (2 * 16 * 256 + 2 * 8 * 256) * H26
ATTN_F_26 = (2 * 16 * 512 + 2 * 512) * H26
MLP_26 = 3 * 2112 * H26
ROUTER_26 = 128 * H26 + H26 + 128
EXPERT_26 = 3 * 704 * H26  # gate_up [2*704, H] + down [H, 704]
NORMS_26 = 25 * (7 * H26 + 1 + 512) + 5 * (7 * H26 + 1 + 1024) + H26  # 4 + 3 MoE norms, scalar, q/k norms; final
LM_HEAD_26 = V * H26


def test_hand_constants_match_the_spec_parameter_counts():
    # §1.1: 31B -> 30.70 B; 26B-A4B -> 25.23 B total, 3.08 B active non-embedding
    assert (LINEAR_31 + LM_HEAD_31) / 1e9 == pytest.approx(30.70, abs=0.005)
    total_26 = 25 * ATTN_S_26 + 5 * ATTN_F_26 + 30 * (MLP_26 + ROUTER_26 + 128 * EXPERT_26) + LM_HEAD_26
    assert total_26 / 1e9 == pytest.approx(25.23, abs=0.005)
    active_26 = 25 * ATTN_S_26 + 5 * ATTN_F_26 + 30 * (MLP_26 + ROUTER_26 + 8 * EXPERT_26)
    assert active_26 / 1e9 == pytest.approx(3.08, abs=0.005)


def test_31b_decode_weight_bytes_and_bound():
    cfg = get_preset("31b")
    w = step_weight_params(cfg)
    assert w.attention == 50 * ATTN_S_31 + 10 * ATTN_F_31
    assert w.mlp == 60 * MLP_31
    assert w.lm_head == LM_HEAD_31
    assert w.norms == NORMS_31
    assert w.moe_experts == 0 and w.ple == 0
    weight_bytes = 2 * (LINEAR_31 + LM_HEAD_31 + NORMS_31)
    assert weight_bytes / 1e9 == pytest.approx(61.39, abs=0.01)  # "~61.4 GB"
    # B = 1 at context 1: KV is 50 + 10 layers x 1 token
    kv_1 = 50 * 16 * KIB + 10 * 8 * KIB
    assert decode_step_bytes(cfg, [1]) == weight_bytes + kv_1
    peak = get_gpu_peak("h200", MEASURED_H200)
    flops = decode_step_flops(cfg, [1])
    assert bound_ms(decode_step_bytes(cfg, [1]), flops, peak) == pytest.approx(weight_bytes / 4.3e12 * 1e3, rel=1e-4)
    assert bound_ms(decode_step_bytes(cfg, [1]), flops, peak) == pytest.approx(14.28, abs=0.01)  # "~14.3 ms"


def test_31b_kv_bytes_window_applied():
    cfg = get_preset("31b")
    # §2.7: 31B per token = 50 x 16 KiB (sliding) + 10 x 8 KiB (full)
    assert kv_cache_bytes_per_token(cfg) == {"sliding": 50 * 16 * KIB, "full": 10 * 8 * KIB}
    # context 8192: sliding layers read W = 1024 tokens, full layers 8192
    assert decode_kv_read_bytes(cfg, [8192]) == 50 * 1024 * 16 * KIB + 10 * 8192 * 8 * KIB
    # context 1000 < W: every layer reads 1000 tokens
    assert decode_kv_read_bytes(cfg, [1000]) == 50 * 1000 * 16 * KIB + 10 * 1000 * 8 * KIB
    # batch = sum over requests
    two = decode_kv_read_bytes(cfg, [8192, 1000])
    assert two == decode_kv_read_bytes(cfg, [8192]) + decode_kv_read_bytes(cfg, [1000])
    # §2.7 example: 256K context of full layers = 80 KiB x 262144 = 20 GiB
    assert kv_cache_bytes_per_token(cfg)["full"] * 262144 == 20 * 2**30


def test_26b_decode_only_active_experts():
    cfg = get_preset("26b-a4b")
    w = step_weight_params(cfg)
    assert w.attention == 25 * ATTN_S_26 + 5 * ATTN_F_26
    assert w.mlp == 30 * MLP_26  # the always-on dense MLP
    assert w.moe_router == 30 * ROUTER_26
    assert w.moe_experts == 30 * 8 * EXPERT_26  # top-8 of 128 for one token
    assert w.lm_head == LM_HEAD_26
    assert w.norms == NORMS_26
    weight_bytes = 2 * (w.attention + w.mlp + w.moe_router + 30 * 8 * EXPERT_26 + LM_HEAD_26 + NORMS_26)
    assert weight_bytes / 1e9 == pytest.approx(7.645, abs=0.001)
    kv = 25 * 1024 * 8 * KIB + 5 * 8192 * 4 * KIB  # §2.7: 26B sliding 8 KiB, full 4 KiB per token per layer
    assert decode_step_bytes(cfg, [8192]) == weight_bytes + kv
    peak = get_gpu_peak("h200", MEASURED_H200)
    assert bound_ms(decode_step_bytes(cfg, [8192]), 0.0, peak) == pytest.approx((weight_bytes + kv) / 4.3e9)


def test_26b_batch_reads_expected_distinct_experts():
    cfg = get_preset("26b-a4b")
    hit = 128 * (1 - (120 / 128) ** 4)  # 4 tokens x top-8 of 128, uniform routing
    assert hit == pytest.approx(29.123046875)
    assert expected_active_experts(128, 8, 4) == pytest.approx(hit)
    assert expected_active_experts(128, 8, 1) == 8
    assert expected_active_experts(128, 8, 10_000) == pytest.approx(128)
    assert step_weight_params(cfg, num_tokens=4).moe_experts == pytest.approx(30 * hit * EXPERT_26)
    # FLOPs still use top-8 per token
    assert step_weight_params(cfg, num_tokens=4, experts="per_token").moe_experts == 30 * 8 * EXPERT_26


def test_weights_agree_with_param_count():
    # decode reads every active parameter, with the tied LM head in place of the (gathered) embedding tables
    for name in ("31b", "26b-a4b", "e2b", "e4b", "tiny-moe"):
        cfg = get_preset(name)
        pc = param_count(cfg)
        assert step_weight_params(cfg).total == pc.active - pc.embedding + cfg.vocab_size * cfg.hidden_size, name


def test_kv_shared_layers_read_source_cache():
    cfg = get_preset("e2b")  # 35 layers: 28 S (kvh 1, hd 256) + 7 F (kvh 1, hd 512); 20 KV-shared
    # §2.7: storage from the 15 owning layers = 12 x 1 KiB + 3 x 2 KiB
    assert kv_cache_bytes_per_token(cfg) == {"sliding": 12 * KIB, "full": 3 * 2 * KIB}
    # reads: all 35 layers read (shared ones their source's cache); sliding window 512
    assert decode_kv_read_bytes(cfg, [4096]) == 28 * 512 * KIB + 7 * 4096 * 2 * KIB


def test_attention_pairs_causal_and_window():
    assert attention_pairs(1000) == 1000 * 1001 // 2
    assert attention_pairs(4096, window=1024) == 1024 * 1025 // 2 + (4096 - 1024) * 1024
    assert attention_pairs(1, prefix_tokens=8191) == 8192  # decode at ctx 8192, full
    assert attention_pairs(1, prefix_tokens=8191, window=1024) == 1024  # sliding
    # chunked prefill: two chunks sum to the whole
    assert attention_pairs(2048, 0, 1024) + attention_pairs(2048, 2048, 1024) == attention_pairs(4096, 0, 1024)


def test_31b_prefill_flops_by_hand():
    cfg = get_preset("31b")
    n = 1000  # below the window: plain causal everywhere
    pairs = n * (n + 1) // 2
    attn = 50 * 4 * 32 * 256 * pairs + 10 * 4 * 32 * 512 * pairs
    expected = 2 * LINEAR_31 * n + 2 * LM_HEAD_31 + attn  # LM head for the sampled position only
    assert prefill_flops(cfg, [n]) == pytest.approx(expected, rel=1e-12)
    assert expected / 1e12 == pytest.approx(59.72, abs=0.01)
    n = 4096
    s_pairs = 1024 * 1025 // 2 + (n - 1024) * 1024
    f_pairs = n * (n + 1) // 2
    expected = 2 * LINEAR_31 * n + 2 * LM_HEAD_31 + 50 * 4 * 32 * 256 * s_pairs + 10 * 4 * 32 * 512 * f_pairs
    assert prefill_flops(cfg, [n]) == pytest.approx(expected, rel=1e-12)
    # two sequences = the sum of each
    assert prefill_flops(cfg, [n, 1000]) == pytest.approx(prefill_flops(cfg, [n]) + prefill_flops(cfg, [1000]))


def test_26b_prefill_flops_uses_top8():
    cfg = get_preset("26b-a4b")
    n = 512
    pairs = n * (n + 1) // 2
    per_tok = 25 * ATTN_S_26 + 5 * ATTN_F_26 + 30 * (MLP_26 + ROUTER_26 + 8 * EXPERT_26)
    attn = 25 * 4 * 16 * 256 * pairs + 5 * 4 * 16 * 512 * pairs
    assert prefill_flops(cfg, [n]) == pytest.approx(2 * per_tok * n + 2 * LM_HEAD_26 + attn, rel=1e-12)


def test_gpu_peaks_and_measured_overrides():
    h200 = get_gpu_peak("h200")
    assert h200.hbm_tb_s == 4.8 and h200.bf16_tflops == pytest.approx(989.4) and h200.source == "datasheet"
    m = get_gpu_peak("H200", MEASURED_H200)
    assert m.bytes_per_s == 4.3e12 and m.flops_per_s("bf16") == 790e12 and m.source == "measured"
    assert m.fp8_tflops == h200.fp8_tflops  # untouched fields keep the datasheet value
    assert get_gpu_peak("a100-80gb").fp8_tflops is None
    with pytest.raises(ValueError):
        get_gpu_peak("a100-80gb").flops_per_s("fp8")
    with pytest.raises(ValueError):
        get_gpu_peak("h200", {"hbm": 1.0})
    with pytest.raises(ValueError):
        get_gpu_peak("v100")
    assert match_gpu("NVIDIA H200") == "h200"
    assert match_gpu("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert match_gpu("NVIDIA B200") == "b200"
    assert match_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert match_gpu("NVIDIA L40S") == "l40s"
    assert match_gpu("NVIDIA GeForce RTX 4090") is None


def test_mbu_mfu_and_section():
    cfg = get_preset("31b")
    peak = get_gpu_peak("h200", MEASURED_H200)
    weight_bytes = 2 * (LINEAR_31 + LM_HEAD_31 + NORMS_31)
    kv = 50 * 16 * KIB + 10 * 8 * KIB
    # a 16 ms decode step moving 61.39 GB achieves 3.84 TB/s = 89.2 % of 4.3 TB/s
    assert mbu(weight_bytes + kv, 16.0, peak) == pytest.approx((weight_bytes + kv) / 0.016 / 4.3e12)
    assert mbu(weight_bytes + kv, 16.0, peak) == pytest.approx(0.892, abs=0.001)
    assert mfu(790e12 * 0.010, 20.0, peak) == pytest.approx(0.5)
    sec = roofline_section(cfg, peak, decode_ctx_lens=[1], decode_step_ms=16.0, prefill_seq_lens=[1000], prefill_ms=90)
    assert isinstance(sec, RooflineSection)
    assert sec.decode_bytes == weight_bytes + kv
    assert sec.decode_bound_ms == pytest.approx(14.28, abs=0.01)
    assert sec.mbu == pytest.approx(0.892, abs=0.001)
    assert sec.prefill_flops / 1e12 == pytest.approx(59.72, abs=0.01)
    assert sec.prefill_bound_ms == pytest.approx(59.72e12 / 790e12 * 1e3, rel=1e-3)  # compute-bound: 75.6 ms
    assert sec.mfu == pytest.approx(sec.prefill_flops / 0.090 / 790e12)
    assert "measured" in sec.gpu
    empty = roofline_section(cfg, peak)
    assert empty.decode_bound_ms is None and empty.mbu is None and empty.mfu is None


def test_31b_serving_bound_by_hand():
    """ISL 1024 / OSL 128 at concurrency 64: a compute-bound wave, ~1,480 output tok/s at most on the H200."""
    cfg = get_preset("31b")
    peak = get_gpu_peak("h200", MEASURED_H200)
    isl, osl, C = 1024, 128, 64
    ctx_sum = sum(range(isl + 1, isl + osl))  # the 127 decode tokens' contexts, 1025..1151
    assert ctx_sum == 138176
    pairs = isl * (isl + 1) // 2  # prefill (query, key) pairs; W = 1024 = ISL: the window cuts nothing
    attn = 50 * 4 * 32 * 256 * (pairs + 127 * 1024) + 10 * 4 * 32 * 512 * (pairs + ctx_sum)
    flops_req = 2 * LINEAR_31 * isl + 2 * LM_HEAD_31 + 127 * 2 * (LINEAR_31 + LM_HEAD_31) + attn
    kv_req = 50 * 16 * KIB * 1024 * 127 + 10 * 8 * KIB * ctx_sum
    bytes_wave = osl * 2 * (LINEAR_31 + LM_HEAD_31 + NORMS_31) + C * kv_req
    sb = serving_bound(cfg, peak, isl, osl, C)
    assert sb.flops == pytest.approx(C * flops_req, rel=1e-12)
    assert sb.bytes == pytest.approx(bytes_wave, rel=1e-12)
    assert sb.compute_bound and sb.bound_s == pytest.approx(C * flops_req / 790e12)
    assert sb.output_tok_s_bound == pytest.approx(C * osl / (C * flops_req / 790e12))
    assert 1450 < sb.output_tok_s_bound < 1500
    # serial kernels: the decode attention (127 tokens per request) adds its KV read to the compute time
    decode_attn = C * (50 * 4 * 32 * 256 * 127 * 1024 + 10 * 4 * 32 * 512 * ctx_sum)
    serial = (C * flops_req - decode_attn) / 790e12 + C * kv_req / 4.3e12
    assert sb.serial_bound_s == pytest.approx(serial, rel=1e-12)
    assert sb.output_tok_s_bound_serial == pytest.approx(C * osl / serial)
    assert 1100 < sb.output_tok_s_bound_serial < 1150  # 10x an HF peer at 132 tok/s would be 1,320
    # batch 1: memory-bound, ~1 / 14.5 ms per token once the prefill is amortised over 128 tokens
    one = serving_bound(cfg, peak, isl, osl, 1)
    assert not one.compute_bound and one.output_tok_s_bound == pytest.approx(128 / (one.bytes / 4.3e12))
    # NVFP4 decoder weights (~0.5625 B/param) with a bf16 LM head and FP8 KV read fewer bytes
    q = serving_bound(cfg, peak, isl, osl, 1, weight_dtype_bytes=0.5625, kv_dtype_bytes=1.0, lm_head_dtype_bytes=2.0)
    assert q.bytes == pytest.approx(osl * (0.5625 * (LINEAR_31 + NORMS_31) + 2 * LM_HEAD_31) + kv_req / 2, rel=1e-12)
    sec = roofline_section(cfg, peak, serving=(isl, osl, C), output_tok_s=740.0)
    assert sec.output_tok_s_bound == pytest.approx(sb.output_tok_s_bound)
    assert sec.output_tok_s_bound_serial == pytest.approx(sb.output_tok_s_bound_serial)
    assert one.serial_bound_s >= one.bound_s
    assert sec.throughput_fraction == pytest.approx(740.0 / sb.output_tok_s_bound)
    assert "compute-bound" in sec.notes
