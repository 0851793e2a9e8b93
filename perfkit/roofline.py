"""Roofline: bytes and FLOPs per step from a Gemma4Config -> lower-bound time, MBU, MFU.

Pure functions, no torch. Conventions (state them in reports):

Decode step (B requests, one new token each, request b attends to `ctx_lens[b]` tokens including the new one):
- weights read once per step: every linear layer's weight, norms, the tied LM head in full (vocab x hidden);
  the embedding-row gather (B rows) and PLE-table gathers are negligible and not counted;
- MoE (26B-A4B): router + only the experts some token of the batch routes to: `top_k` of `num_experts` for
  B = 1, in expectation `E * (1 - (1 - k/E)^B)` for B tokens under uniform routing; the dense MLP always;
- KV read per layer: sliding layers `min(ctx, W)` tokens, full layers `ctx` tokens; KV-shared layers read
  their source layer's cache (counted again: it is read again); K and V both stored and read on K=V layers;
- FLOPs: 2 x active linear params per token (top_k experts) + LM head + attention 4·heads·head_dim per
  visible (query, key) pair (QK^T and PV).

Prefill (sequences of `seq_lens` new tokens after `prefix_lens` cached ones): 2 x active linear params x
tokens + LM head only for one position per sequence (the sampled one) + attention over the causal pairs
(sliding layers: keys within the window). Bidirectional vision spans and the softmax/elementwise work are
not counted.

Serving (a closed loop of C requests, each ISL prompt tokens then OSL output tokens; `serving_bound`): per wave
of C requests the FLOPs are C x (prefill of ISL + OSL - 1 decode tokens at contexts ISL+1 .. ISL+OSL-1); the bytes
are at least OSL steps x the weights (a request needs OSL sequential steps; concurrent requests can share a
step's weight read, so C requests need no more than OSL steps) + each decode token's KV read. The wave takes at
least max(FLOPs / peak, bytes / bandwidth) (perfect overlap of compute and memory): `output_tok_s_bound` =
C x OSL / that time. No schedule beats it; a measured output_tok_s above it means the accounting is wrong.
`output_tok_s_bound_serial` is the ceiling of an engine whose kernels of one step run one after another (this
runtime, vLLM, TensorRT-LLM): a layer's decode attention needs that layer's qkv GEMM and feeds its o_proj, so its
KV read (memory-bound) cannot hide under GEMM compute; the wave then takes at least (FLOPs other than decode
attention) / peak + decode KV bytes / bandwidth.

Weight bytes: `weight_dtype_bytes` per parameter of the decoder layers (the quantised ones: fp8 ~1 + scales,
nvfp4 ~0.56); the tied embedding / LM head at `lm_head_dtype_bytes` (it stays in the model dtype).

bound = max(bytes / peak bandwidth, FLOPs / peak FLOP/s). MBU = achieved bytes/s / peak bandwidth,
MFU = achieved FLOP/s / peak FLOP/s, with the achieved rate from a measured step time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from perfkit.results import RooflineSection

if TYPE_CHECKING:
    from perfkit.runtime.model_config import Gemma4Config


# ---- GPU peaks ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuPeak:
    """Dense (no sparsity) tensor-core peaks and memory bandwidth. TFLOP/s = 1e12 FLOP/s, TB/s = 1e12 B/s."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    hbm_tb_s: float
    fp4_tflops: float | None = None
    source: str = "datasheet"

    def flops_per_s(self, compute_dtype: str = "bf16") -> float:
        tf = {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops, "fp8": self.fp8_tflops, "fp4": self.fp4_tflops}
        if compute_dtype not in tf:
            raise ValueError(f"compute dtype {compute_dtype!r}; allowed: {', '.join(tf)}")
        v = tf[compute_dtype]
        if v is None:
            raise ValueError(f"{self.name} has no {compute_dtype} tensor-core peak")
        return v * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_tb_s * 1e12


GPU_PEAKS: dict[str, GpuPeak] = {
    "a100-80gb": GpuPeak("a100-80gb", bf16_tflops=312.0, fp8_tflops=None, hbm_tb_s=2.039),
    "h100-sxm": GpuPeak("h100-sxm", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_tb_s=3.35),
    "h200": GpuPeak("h200", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_tb_s=4.8),
    "b200": GpuPeak("b200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_tb_s=8.0, fp4_tflops=9000.0),
    "l40s": GpuPeak("l40s", bf16_tflops=362.05, fp8_tflops=733.0, hbm_tb_s=0.864),
}

# What the perfkit H200 machine actually reaches: large bf16 matmul and a device-to-device copy.
MEASURED_H200: dict[str, float] = {"bf16_tflops": 790.0, "hbm_tb_s": 4.3}


def get_gpu_peak(name: str, measured: dict[str, float] | None = None) -> GpuPeak:
    """Datasheet peaks by key (see GPU_PEAKS), with `measured` overrides (e.g. {"bf16_tflops": 790,
    "hbm_tb_s": 4.3}) replacing those fields and marking the source "measured"."""
    key = name.lower()
    if key not in GPU_PEAKS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_PEAKS)}")
    peak = GPU_PEAKS[key]
    if measured:
        allowed = {"bf16_tflops", "fp8_tflops", "fp4_tflops", "hbm_tb_s"}
        bad = sorted(set(measured) - allowed)
        if bad:
            raise ValueError(f"measured overrides {bad}; allowed: {', '.join(sorted(allowed))}")
        peak = replace(peak, source="measured", **{k: float(v) for k, v in measured.items()})
    return peak


def match_gpu(device_name: str) -> str | None:
    """GPU_PEAKS key for a CUDA / NVML device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ...), or None."""
    n = device_name.lower()
    if "h200" in n:
        return "h200"
    if "b200" in n:
        return "b200"
    if "h100" in n and ("sxm" in n or "hbm3" in n):
        return "h100-sxm"
    if "a100" in n and "80gb" in n:
        return "a100-80gb"
    if "l40s" in n:
        return "l40s"
    return None


# ---- weights -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightParams:
    """Parameters touched by one step, by group (counts, not bytes). `moe_experts` may be fractional (expected)."""

    attention: float = 0.0
    mlp: float = 0.0
    moe_router: float = 0.0
    moe_experts: float = 0.0
    ple: float = 0.0
    norms: float = 0.0
    lm_head: float = 0.0

    @property
    def total(self) -> float:
        return self.attention + self.mlp + self.moe_router + self.moe_experts + self.ple + self.norms + self.lm_head


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected number of distinct experts hit by `num_tokens` tokens, each routing to `top_k` distinct experts
    uniformly at random: E·(1 − (1 − k/E)^n). Exactly k for one token, E in the limit."""
    if num_experts <= 0 or num_tokens <= 0:
        return 0.0
    if num_tokens == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def step_weight_params(cfg: Gemma4Config, num_tokens: int = 1, experts: str = "distinct") -> WeightParams:
    """Parameters of the linear layers + norms touched by a step over `num_tokens` tokens, plus the LM head.

    `experts="distinct"`: MoE experts counted once per distinct expert hit (what is read from memory);
    `experts="per_token"`: top_k experts (what one token computes with; for FLOPs)."""
    H = cfg.hidden_size
    nh = cfg.num_attention_heads
    attn = mlp = router = ex = ple = norms = 0.0
    for i in range(cfg.num_hidden_layers):
        hd, kvh = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        attn += 2 * nh * hd * H  # q_proj, o_proj
        norms += hd  # q_norm
        if not cfg.is_kv_shared(i):
            attn += kvh * hd * H  # k_proj
            norms += hd  # k_norm
            if not cfg.layer_k_eq_v(i):
                attn += kvh * hd * H  # v_proj
        mlp += 3 * H * cfg.layer_intermediate_size(i)  # gate, up, down
        norms += 4 * H + 1  # input/post-attn/pre-ffw/post-ffw norms + layer_scalar
        if cfg.enable_moe_block:
            E, k, Im = cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size
            router += E * H + H + E  # proj, scale, per_expert_scale
            norms += 3 * H  # pre_ffw_2, post_ffw_1, post_ffw_2
            n_ex = k if experts == "per_token" else expected_active_experts(E, k, num_tokens)
            ex += n_ex * 3 * Im * H  # gate_up [2·Im, H] + down [H, Im]
        if cfg.has_ple:
            P = cfg.hidden_size_per_layer_input
            ple += 2 * H * P  # per_layer_input_gate, per_layer_projection
            norms += H  # post_per_layer_input_norm
    norms += H  # final norm
    if cfg.has_ple:
        P, L = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
        ple += L * P * H  # per_layer_model_projection
        norms += P  # per_layer_projection_norm
    return WeightParams(
        attention=attn, mlp=mlp, moe_router=router, moe_experts=ex, ple=ple, norms=norms,
        lm_head=float(cfg.vocab_size * H),
    )  # fmt: skip


# ---- KV cache ----------------------------------------------------------------------------------------------------
def kv_bytes_per_token_per_layer(cfg: Gemma4Config, layer: int, kv_dtype_bytes: float = 2.0) -> float:
    """K + V bytes one token occupies in one layer's cache (K=V layers store both)."""
    return 2 * cfg.layer_kv_heads(layer) * cfg.layer_head_dim(layer) * kv_dtype_bytes


def kv_cache_bytes_per_token(cfg: Gemma4Config, kv_dtype_bytes: float = 2.0) -> dict[str, float]:
    """Storage per token over the cache-owning layers: {"sliding": ..., "full": ...} (sliding capped at W tokens)."""
    out = {"sliding": 0.0, "full": 0.0}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_kv_shared(i):
            out["sliding" if cfg.is_sliding(i) else "full"] += kv_bytes_per_token_per_layer(cfg, i, kv_dtype_bytes)
    return out


def decode_kv_read_bytes(cfg: Gemma4Config, ctx_lens: Sequence[int], kv_dtype_bytes: float = 2.0) -> float:
    """KV bytes one decode step reads: every layer (KV-shared ones read their source's cache) over each request's
    visible tokens: min(ctx, W) on sliding layers, ctx on full layers."""
    W = cfg.sliding_window
    sum_full = float(sum(ctx_lens))
    sum_slide = float(sum(min(c, W) for c in ctx_lens))
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        per_tok = kv_bytes_per_token_per_layer(cfg, cfg.cache_layer(i), kv_dtype_bytes)
        total += per_tok * (sum_slide if cfg.is_sliding(i) else sum_full)
    return total


# ---- attention pairs ---------------------------------------------------------------------------------------------
def _capped_triangle(m: int, window: int | None) -> int:
    """sum_{j=1..m} min(j, W) (W = None: no cap)."""
    if m <= 0:
        return 0
    if window is None or m <= window:
        return m * (m + 1) // 2
    return window * (window + 1) // 2 + (m - window) * window


def attention_pairs(new_tokens: int, prefix_tokens: int = 0, window: int | None = None) -> int:
    """Visible (query, key) pairs for `new_tokens` causal queries after `prefix_tokens` cached keys; query at
    absolute position i sees min(i + 1, W) keys."""
    return _capped_triangle(prefix_tokens + new_tokens, window) - _capped_triangle(prefix_tokens, window)


def attention_flops(cfg: Gemma4Config, new_tokens: int, prefix_tokens: int = 0) -> float:
    """QK^T + PV FLOPs of one sequence over all layers: 4 · heads · head_dim per visible pair."""
    total = 0.0
    nh = cfg.num_attention_heads
    for i in range(cfg.num_hidden_layers):
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        total += 4.0 * nh * cfg.layer_head_dim(i) * attention_pairs(new_tokens, prefix_tokens, window)
    return total


# ---- per step ----------------------------------------------------------------------------------------------------
def _linear_params_per_token(cfg: Gemma4Config) -> float:
    """Matmul parameters one token multiplies with (top_k experts), LM head excluded."""
    w = step_weight_params(cfg, 1, experts="per_token")
    return w.attention + w.mlp + w.moe_router + w.moe_experts + w.ple


def step_weight_bytes(
    cfg: Gemma4Config, num_tokens: int = 1, weight_dtype_bytes: float = 2.0, lm_head_dtype_bytes: float | None = None
) -> float:
    """Weight bytes one step over `num_tokens` tokens reads: decoder parameters at `weight_dtype_bytes`, the LM
    head at `lm_head_dtype_bytes` (default: the same)."""
    w = step_weight_params(cfg, num_tokens=num_tokens)
    head = weight_dtype_bytes if lm_head_dtype_bytes is None else lm_head_dtype_bytes
    return (w.total - w.lm_head) * weight_dtype_bytes + w.lm_head * head


def decode_step_bytes(
    cfg: Gemma4Config,
    ctx_lens: Sequence[int],
    weight_dtype_bytes: float = 2.0,
    kv_dtype_bytes: float = 2.0,
    lm_head_dtype_bytes: float | None = None,
) -> float:
    """Bytes one decode step reads for a batch of len(ctx_lens) requests: weights + KV."""
    w = step_weight_bytes(cfg, len(ctx_lens), weight_dtype_bytes, lm_head_dtype_bytes)
    return w + decode_kv_read_bytes(cfg, ctx_lens, kv_dtype_bytes)


def decode_step_flops(cfg: Gemma4Config, ctx_lens: Sequence[int]) -> float:
    """FLOPs of one decode step: linear layers + LM head per request + attention over each request's context."""
    B = len(ctx_lens)
    lin = 2.0 * (_linear_params_per_token(cfg) + cfg.vocab_size * cfg.hidden_size) * B
    return lin + sum(attention_flops(cfg, 1, c - 1) for c in ctx_lens)


def prefill_flops(cfg: Gemma4Config, seq_lens: Sequence[int], prefix_lens: Sequence[int] | None = None) -> float:
    """FLOPs of a prefill of sequences with `seq_lens` new tokens (after `prefix_lens` cached tokens): linear
    layers for every token, the LM head once per sequence, causal (windowed on sliding layers) attention."""
    prefix = list(prefix_lens) if prefix_lens is not None else [0] * len(seq_lens)
    tokens = sum(seq_lens)
    lin = 2.0 * _linear_params_per_token(cfg) * tokens + 2.0 * cfg.vocab_size * cfg.hidden_size * len(seq_lens)
    return lin + sum(attention_flops(cfg, n, p) for n, p in zip(seq_lens, prefix, strict=True))


def prefill_bytes(
    cfg: Gemma4Config,
    seq_lens: Sequence[int],
    prefix_lens: Sequence[int] | None = None,
    weight_dtype_bytes: float = 2.0,
    kv_dtype_bytes: float = 2.0,
    lm_head_dtype_bytes: float | None = None,
) -> float:
    """Minimum bytes a prefill moves: weights once (distinct experts over all tokens) + KV written for the new
    tokens on owning layers + KV of the prefix read once per layer (windowed on sliding layers)."""
    prefix = list(prefix_lens) if prefix_lens is not None else [0] * len(seq_lens)
    w = step_weight_bytes(cfg, sum(seq_lens), weight_dtype_bytes, lm_head_dtype_bytes)
    per_tok = kv_cache_bytes_per_token(cfg, kv_dtype_bytes)
    kv_write = (per_tok["sliding"] + per_tok["full"]) * sum(seq_lens)
    kv_read = decode_kv_read_bytes(cfg, [p for p in prefix if p > 0], kv_dtype_bytes)
    return w + kv_write + kv_read


@dataclass(frozen=True)
class ServingBound:
    """Lower bound on one wave of a closed-loop ISL/OSL workload (see the module docstring)."""

    concurrency: int
    flops: float  # the wave's FLOPs
    bytes: float  # the wave's minimum bytes (OSL weight reads + KV reads)
    bound_s: float  # max(flops / peak, bytes / bandwidth)
    compute_bound: bool
    output_tok_s_bound: float  # concurrency * osl / bound_s
    serial_bound_s: float  # >= bound_s: decode attention's KV read added to the compute time (module docstring)
    output_tok_s_bound_serial: float  # concurrency * osl / serial_bound_s


def serving_bound(
    cfg: Gemma4Config,
    peak: GpuPeak,
    isl: int,
    osl: int,
    concurrency: int,
    weight_dtype_bytes: float = 2.0,
    kv_dtype_bytes: float = 2.0,
    lm_head_dtype_bytes: float | None = None,
    compute_dtype: str = "bf16",
) -> ServingBound:
    """Output-throughput ceiling of `concurrency` requests in flight, each `isl` prompt + `osl` output tokens.
    The expert reads of MoE decode steps are counted for a batch of `concurrency` tokens."""
    C, steps = max(1, concurrency), max(1, osl)
    ctxs = list(range(isl + 1, isl + osl))  # the decode tokens' contexts (the first token comes from the prefill)
    per_req_flops = prefill_flops(cfg, [isl]) + sum(decode_step_flops(cfg, [c]) for c in ctxs)
    per_req_kv = sum(decode_kv_read_bytes(cfg, [c], kv_dtype_bytes) for c in ctxs)
    flops = C * per_req_flops
    bytes_ = steps * step_weight_bytes(cfg, C, weight_dtype_bytes, lm_head_dtype_bytes) + C * per_req_kv
    t_flops, t_bytes = flops / peak.flops_per_s(compute_dtype), bytes_ / peak.bytes_per_s
    bound = max(t_flops, t_bytes)
    decode_attn_flops = C * sum(attention_flops(cfg, 1, c - 1) for c in ctxs)
    serial = max(
        bound, (flops - decode_attn_flops) / peak.flops_per_s(compute_dtype) + C * per_req_kv / peak.bytes_per_s
    )
    return ServingBound(C, flops, bytes_, bound, t_flops >= t_bytes, C * osl / bound, serial, C * osl / serial)


def bound_ms(bytes_: float, flops: float, peak: GpuPeak, compute_dtype: str = "bf16") -> float:
    """Roofline lower bound: max(memory time, compute time), in ms."""
    return 1e3 * max(bytes_ / peak.bytes_per_s, flops / peak.flops_per_s(compute_dtype))


def mbu(bytes_: float, measured_ms: float, peak: GpuPeak) -> float:
    """Model bandwidth utilisation: (bytes / measured time) / peak bandwidth."""
    return bytes_ / (measured_ms / 1e3) / peak.bytes_per_s


def mfu(flops: float, measured_ms: float, peak: GpuPeak, compute_dtype: str = "bf16") -> float:
    """Model FLOP utilisation: (FLOPs / measured time) / peak FLOP/s."""
    return flops / (measured_ms / 1e3) / peak.flops_per_s(compute_dtype)


def roofline_section(
    cfg: Gemma4Config,
    peak: GpuPeak,
    *,
    decode_ctx_lens: Sequence[int] | None = None,
    decode_step_ms: float | None = None,
    prefill_seq_lens: Sequence[int] | None = None,
    prefill_ms: float | None = None,
    weight_dtype_bytes: float = 2.0,
    kv_dtype_bytes: float = 2.0,
    compute_dtype: str = "bf16",
    lm_head_dtype_bytes: float | None = None,
    serving: tuple[int, int, int] | None = None,
    output_tok_s: float | None = None,
) -> RooflineSection:
    """RooflineSection for one scenario.

    `decode_ctx_lens`: the contexts of a representative decode step (e.g. [ISL + OSL // 2] * concurrency);
    `decode_step_ms`: its measured time (forward_decode device mean, or TPOT for a fixed batch).
    `prefill_seq_lens` / `prefill_ms`: one measured prefill (e.g. the TTFT-defining forward_prefill).
    MBU comes from decode; MFU from prefill when measured, else from decode.
    `serving` = (isl, osl, concurrency): adds the closed-loop throughput ceiling (`serving_bound`) and, with the
    measured `output_tok_s`, the fraction of it reached."""
    sec = RooflineSection(gpu=f"{peak.name} ({peak.source})")
    notes = [f"dtype bytes: weights {weight_dtype_bytes:g}, kv {kv_dtype_bytes:g}; compute {compute_dtype}"]
    d_flops = None
    if decode_ctx_lens:
        sec.decode_bytes = decode_step_bytes(cfg, decode_ctx_lens, weight_dtype_bytes, kv_dtype_bytes,
                                             lm_head_dtype_bytes)  # fmt: skip
        d_flops = decode_step_flops(cfg, decode_ctx_lens)
        sec.decode_bound_ms = bound_ms(sec.decode_bytes, d_flops, peak, compute_dtype)
        B = len(decode_ctx_lens)
        notes.append(f"decode batch {B}, mean ctx {sum(decode_ctx_lens) / B:.0f}")
        if decode_step_ms and decode_step_ms > 0:
            sec.mbu = mbu(sec.decode_bytes, decode_step_ms, peak)
    if prefill_seq_lens:
        sec.prefill_flops = prefill_flops(cfg, prefill_seq_lens)
        p_bytes = prefill_bytes(cfg, prefill_seq_lens, None, weight_dtype_bytes, kv_dtype_bytes, lm_head_dtype_bytes)
        sec.prefill_bound_ms = bound_ms(p_bytes, sec.prefill_flops, peak, compute_dtype)
        notes.append(f"prefill {len(prefill_seq_lens)} seq, {sum(prefill_seq_lens)} tokens")
        if prefill_ms and prefill_ms > 0:
            sec.mfu = mfu(sec.prefill_flops, prefill_ms, peak, compute_dtype)
            notes.append("mfu from prefill")
    if sec.mfu is None and d_flops is not None and decode_step_ms and decode_step_ms > 0:
        sec.mfu = mfu(d_flops, decode_step_ms, peak, compute_dtype)
        notes.append("mfu from decode")
    if serving is not None:
        isl, osl, conc = serving
        sb = serving_bound(cfg, peak, isl, osl, conc, weight_dtype_bytes, kv_dtype_bytes, lm_head_dtype_bytes,
                           compute_dtype)  # fmt: skip
        sec.output_tok_s_bound = sb.output_tok_s_bound
        sec.output_tok_s_bound_serial = sb.output_tok_s_bound_serial
        if output_tok_s:
            sec.throughput_fraction = output_tok_s / sb.output_tok_s_bound
        notes.append(f"serving bound: isl {isl}, osl {osl}, concurrency {conc}, "
                     f"{'compute' if sb.compute_bound else 'memory'}-bound")  # fmt: skip
    sec.notes = "; ".join(notes)
    return sec


__all__ = [
    "GPU_PEAKS",
    "MEASURED_H200",
    "GpuPeak",
    "WeightParams",
    "attention_flops",
    "attention_pairs",
    "bound_ms",
    "decode_kv_read_bytes",
    "decode_step_bytes",
    "decode_step_flops",
    "expected_active_experts",
    "get_gpu_peak",
    "kv_bytes_per_token_per_layer",
    "kv_cache_bytes_per_token",
    "match_gpu",
    "mbu",
    "mfu",
    "prefill_bytes",
    "prefill_flops",
    "roofline_section",
    "serving_bound",
    "ServingBound",
    "step_weight_bytes",
    "step_weight_params",
]
