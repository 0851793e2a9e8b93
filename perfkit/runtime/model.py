"""Gemma4 text decoder (shared/reference/gemma4.md §2-§3), flat varlen token layout, attention via a backend.

Module and parameter names follow HF's `Gemma4TextModel` so checkpoint keys map 1:1 once the
`model.language_model.` / `model.` prefix is stripped. Shapes: T tokens in the step, H hidden, nh query heads,
kvh KV heads, hd head dim of the layer (256 sliding / 512 full), L layers, P PLE width, E experts, K top-k.
All matmuls run in the weight dtype; norms, softmax and the final soft-cap run in fp32.

Fused path (`model.set_fused(True)`, default off): the norms, the GeGLU activations, q/k-norm + RoPE (+ v_norm) and
the MoE block run through the Triton kernels in perfkit/kernels/ (rmsnorm, gelu_mul, qk_norm_rope, moe); the
decoder layer then fuses each post-norm + residual add with the pre-norms that read the new residual (sandwich).
Module structure, nn.Linear attributes and parameter names are the same on both paths; triton is imported only
when the fused path is switched on.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from perfkit.runtime.attention.base import AttentionBackend, AttnLayer
from perfkit.runtime.model_config import Gemma4Config


@functools.cache
def _kernels() -> SimpleNamespace:
    """The fused Triton ops, imported on first use (TRITON_INTERPRET must be set before this on CPU)."""
    from perfkit.kernels import gelu_mul, moe, qk_norm_rope, rmsnorm

    return SimpleNamespace(
        rmsnorm=rmsnorm.rmsnorm,
        sandwich=rmsnorm.sandwich_rmsnorm,
        gelu_mul=gelu_mul.gelu_mul,
        qk_norm_rope=qk_norm_rope.qk_norm_rope,
        k_norm_rope_v_norm=qk_norm_rope.k_norm_rope_v_norm,
        head_norm=qk_norm_rope.head_norm,
        moe_routing=moe.moe_routing,
        fused_moe=moe.fused_moe,
    )


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Plain `x * w` RMSNorm (NOT Gemma-2/3's `1 + w`), computed in fp32, cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


class RMSNorm(nn.Module):
    fused = False  # set by Gemma4ForCausalLM.set_fused

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return _kernels().rmsnorm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def round_to(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype` (HF casts its embedding-scale tensors to the weight dtype), as a Python float."""
    return torch.tensor(x, dtype=torch.float32).to(dtype).item()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE. x [T, heads, hd]; cos/sin [T, hd/2] (one entry per frequency; dim d pairs with d+hd/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_inv_freq(cfg: Gemma4Config, sliding: bool) -> Tensor:
    """[hd/2] fp32 inverse frequencies. Sliding: default rope over 256 dims, theta 1e4. Full: "proportional":
    64 live frequencies theta^(-2i/512) (denominator = the full head dim), the other 192 are zero (pass through)."""
    if sliding:
        hd, theta = cfg.head_dim, cfg.rope_theta
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    hd, theta = cfg.global_head_dim, cfg.global_rope_theta
    live = int(cfg.global_partial_rotary_factor * hd // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * live, 2, dtype=torch.float) / hd))
    return torch.cat([inv, torch.zeros(hd // 2 - live)])


class RopeTables:
    """cos/sin [max_positions, hd/2] per layer type, computed once in fp32 and stored in the compute dtype."""

    def __init__(self, cfg: Gemma4Config, max_positions: int, device: torch.device, dtype: torch.dtype):
        self.max_positions = max_positions
        pos = torch.arange(max_positions, device=device, dtype=torch.float)
        self.tables: dict[bool, tuple[Tensor, Tensor]] = {}
        for sliding in (True, False):
            freqs = pos[:, None] * rope_inv_freq(cfg, sliding).to(device)[None, :]  # [P, hd/2] fp32
            self.tables[sliding] = (freqs.cos().to(dtype), freqs.sin().to(dtype))

    def lookup(self, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
        return {s: (c[positions], sn[positions]) for s, (c, sn) in self.tables.items()}


class Gemma4MLP(nn.Module):
    fused = False

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)  # [I, H]
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)  # [I, H]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)  # [H, I]

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        if self.fused:
            return self.down_proj(_kernels().gelu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Gemma4Attention(nn.Module):
    fused = False

    def __init__(self, cfg: Gemma4Config, layer: AttnLayer):
        super().__init__()
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        H, nh, kvh, hd = cfg.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.q_proj = nn.Linear(H, nh * hd, bias=False)  # [nh*hd, H]
        self.o_proj = nn.Linear(nh * hd, H, bias=False)  # [H, nh*hd]
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if layer.writes_kv:
            self.k_proj = nn.Linear(H, kvh * hd, bias=False)  # [kvh*hd, H]
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
            # K=V full layers: V is v_norm(raw k_proj output), so there is no v_proj
            self.v_proj = None if cfg.layer_k_eq_v(layer.index) else nn.Linear(H, kvh * hd, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        if self.fused:
            return self.forward_fused(x, cos, sin, attn)
        T, hd = x.shape[0], self.layer.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, -1, hd)), cos, sin)  # [T, nh, hd]
        k = v = None
        if self.layer.writes_kv:
            k_raw = self.k_proj(x).view(T, -1, hd)  # [T, kvh, hd]
            v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(T, -1, hd)
            k = apply_rope(self.k_norm(k_raw), cos, sin)
            v = rms_norm(v_raw, None, self.eps)  # v_norm: no weight, no rope
        o = attn.attend(self.layer, q, k, v)  # [T, nh, hd]
        return self.o_proj(o.reshape(T, -1))

    def forward_fused(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        """q/k norm + RoPE in one kernel each; K=V layers get k and v_norm(k_raw) from one read of k_raw."""
        K, T, hd = _kernels(), x.shape[0], self.layer.head_dim
        q = K.qk_norm_rope(self.q_proj(x).view(T, -1, hd), self.q_norm.weight, cos, sin, self.eps)
        k = v = None
        if self.layer.writes_kv:
            k_raw = self.k_proj(x).view(T, -1, hd)
            if self.v_proj is None:
                k, v = K.k_norm_rope_v_norm(k_raw, self.k_norm.weight, cos, sin, self.eps)
            else:
                k = K.qk_norm_rope(k_raw, self.k_norm.weight, cos, sin, self.eps)
                v = K.head_norm(self.v_proj(x).view(T, -1, hd), None, self.eps)
        o = attn.attend(self.layer, q, k, v)
        return self.o_proj(o.reshape(T, -1))


class Gemma4Router(nn.Module):
    """softmax(fp32) over experts -> top-k -> renormalise -> * per_expert_scale (HF order)."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.scalar_root_size = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # [E, H]
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))  # [H]
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))  # [E]

    def forward(self, r: Tensor) -> tuple[Tensor, Tensor]:  # r [T, H] un-normed residual
        z = rms_norm(r, None, self.eps) * self.scale * self.scalar_root_size
        probs = torch.softmax(self.proj(z), dim=-1, dtype=torch.float32)  # [T, E]
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx  # fp32 weights [T, K], long idx [T, K]


class Gemma4Experts(nn.Module):
    """E GeGLU experts as stacked 3-D weights (HF layout). No Python loop over all E experts."""

    gather_max_rows = 64  # T*K at or below this: gather the chosen experts' weights (no host sync; decode)
    fused = False

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        E, H, Im = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.intermediate = Im
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Im, H))  # rows [0, Im) gate, [Im, 2Im) up
        self.down_proj = nn.Parameter(torch.empty(E, H, Im))

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:  # x [T, H], idx/w [T, K] -> [T, H]
        if self.fused:  # grouped Triton GEMMs, any T, no host sync
            return _kernels().fused_moe(x, self.gate_up_proj, self.down_proj, w, idx)
        if idx.numel() <= self.gather_max_rows:
            return self.forward_gather(x, idx, w)
        return self.forward_sorted(x, idx, w)

    def _expert(self, x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        gate, up = (x @ gate_up.transpose(-1, -2)).split(self.intermediate, dim=-1)
        return (gelu_tanh(gate) * up) @ down.transpose(-1, -2)

    def forward_gather(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)  # [T*K]
        xs = x.repeat_interleave(K, dim=0)[:, None, :]  # [T*K, 1, H]
        y = self._expert(xs, self.gate_up_proj[flat], self.down_proj[flat])[:, 0]  # [T*K, H]
        y = (y * w.reshape(-1, 1)).to(x.dtype)
        return y.view(T, K, -1).sum(dim=1)

    def forward_sorted(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)  # [T*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # one host sync
        token = order // K  # token of each sorted (token, slot) pair
        xs = x[token]  # [T*K, H] grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._expert(xs[start : start + n], self.gate_up_proj[e], self.down_proj[e])
                start += n
        ys = (ys * w.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(x)
        return out.index_add_(0, token, ys)


class Gemma4DecoderLayer(nn.Module):
    fused = False

    def __init__(self, cfg: Gemma4Config, layer: AttnLayer):
        super().__init__()
        H, eps, i = cfg.hidden_size, cfg.rms_norm_eps, layer.index
        self.is_sliding = layer.is_sliding
        self.self_attn = Gemma4Attention(cfg, layer)
        self.mlp = Gemma4MLP(H, cfg.layer_intermediate_size(i))
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # [1], checkpoint "skip_scale"
        self.enable_moe_block = cfg.enable_moe_block
        if cfg.enable_moe_block:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.has_ple = cfg.has_ple
        if cfg.has_ple:
            P = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)  # [P, H]
            self.per_layer_projection = nn.Linear(P, H, bias=False)  # [H, P]
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionBackend, ple: Tensor | None
    ) -> Tensor:  # h [T, H]; ple [T, P] or None
        if self.fused:
            return self.forward_fused(h, rope, attn, ple)
        r = h
        h = r + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), *rope, attn))
        r = h
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.enable_moe_block:  # parallel dense MLP + MoE; router and experts read the residual r
            w, idx = self.router(r)
            e = self.experts(self.pre_feedforward_layernorm_2(r), idx, w)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h = r + self.post_feedforward_layernorm(m)
        if self.has_ple:
            g = gelu_tanh(self.per_layer_input_gate(h)) * ple  # [T, P]
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar  # scales the whole residual stream

    def forward_fused(
        self, h: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionBackend, ple: Tensor | None
    ) -> Tensor:
        """Same math as `forward`; each post-norm + residual add also emits the pre-norms of the new residual
        (pre_feedforward_layernorm; MoE: pre_feedforward_layernorm_2 and the router's scaled norm), the MoE
        layer's two post-FFN norms are folded into the post_feedforward sandwich, layer_scalar into the last one."""
        K, eps = _kernels(), self.input_layernorm.eps
        a = self.self_attn(K.rmsnorm(h, self.input_layernorm.weight, eps), *rope, attn)
        nxt, mults = [self.pre_feedforward_layernorm.weight], [1.0]
        if self.enable_moe_block:
            nxt += [self.pre_feedforward_layernorm_2.weight, self.router.scale]
            mults += [1.0, self.router.scalar_root_size]
        r, ys = K.sandwich(a, h, self.post_attention_layernorm.weight, eps, next_weights=nxt, next_mults=mults)
        m = self.mlp(ys[0])
        scalar = None if self.has_ple else self.layer_scalar
        x2 = None
        if self.enable_moe_block:
            w, idx = K.moe_routing(self.router.proj(ys[2]), self.router.top_k, self.router.per_expert_scale)
            e = self.experts(ys[1], idx, w)
            x2 = (e, self.post_feedforward_layernorm_1.weight, self.post_feedforward_layernorm_2.weight)
        h, _ = K.sandwich(m, r, self.post_feedforward_layernorm.weight, eps, x2=x2, scalar=scalar)
        if self.has_ple:
            g = K.gelu_mul(self.per_layer_input_gate(h), ple)  # [T, P]
            h, _ = K.sandwich(
                self.per_layer_projection(g), h, self.post_per_layer_input_norm.weight, eps, scalar=self.layer_scalar
            )
        return h


class Gemma4ForCausalLM(nn.Module):
    """Gemma4 text decoder with tied LM head. `forward` takes a flat [T] token layout (no batch dim)."""

    def __init__(self, cfg: Gemma4Config, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.attn_layers = cfg.attn_layers()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            H, L = cfg.hidden_size, cfg.num_hidden_layers
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # [V, H], tied to the LM head
            self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, layer) for layer in self.attn_layers)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            if cfg.has_ple:
                P = cfg.hidden_size_per_layer_input
                self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, L * P)  # [Vp, L*P]
                self.per_layer_model_projection = nn.Linear(H, L * P, bias=False)  # [L*P, H]
                self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps)
        if dtype is not None:
            self.to(dtype)
        self.rope: RopeTables | None = None
        self.fused = False

    def set_fused(self, on: bool) -> None:
        """Route norms, GeGLU, q/k-norm + RoPE and MoE through the Triton kernels (True) or PyTorch (False).

        Switchable on a live model (A/B arms share the weights); both paths compute the same function (fp32 math
        inside the kernels, so bf16 results differ by rounding). CUDA graphs captured under one setting replay it.
        """
        on = bool(on)
        if on:
            _kernels()  # import triton now: fail here rather than inside a forward
        self.fused = on
        for m in self.modules():
            if isinstance(m, (RMSNorm, Gemma4MLP, Gemma4Attention, Gemma4Experts, Gemma4DecoderLayer)):
                m.fused = on

    # ---- helpers -----------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def setup_rope(self, max_positions: int | None = None) -> None:
        """(Re)build the cos/sin tables; called once after the weights are materialised, grown on demand."""
        n = max_positions or min(self.cfg.max_position_embeddings, 8192)
        self.rope = RopeTables(self.cfg, n, self.device, self.dtype)

    def ensure_rope(self, num_positions: int) -> None:
        """Make the tables cover positions [0, num_positions) (grows by doubling; call from the host side)."""
        if self.rope is None or num_positions > self.rope.max_positions:
            have = 0 if self.rope is None else self.rope.max_positions
            self.setup_rope(max(num_positions, 2 * have, min(self.cfg.max_position_embeddings, 8192)))

    def _rope(self, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
        if self.rope is None:
            self.setup_rope()
        assert self.rope is not None
        if positions.device.type == "cpu" and positions.numel():  # no device sync on GPU: callers ensure_rope()
            self.ensure_rope(int(positions.max()) + 1)
        return self.rope.lookup(positions)

    def multimodal_mask(self, input_ids: Tensor) -> Tensor:
        """[T] bool: image/video placeholders (replaced by mm_embeds rows)."""
        return (input_ids == self.cfg.image_token_id) | (input_ids == self.cfg.video_token_id)

    # Table lookups and the LM head matmul, the only steps tensor parallelism changes: perfkit.runtime.tp overrides
    # these three with their vocab-sharded forms and inherits everything around them (mm merge, scales, soft-cap).
    def _token_embeddings(self, text_ids: Tensor) -> Tensor:
        """Unscaled rows of the token embedding table: [T] -> [T, H]."""
        return F.embedding(text_ids, self.embed_tokens.weight)

    def _per_layer_token_embeddings(self, text_ids: Tensor) -> Tensor:
        """Unscaled rows of the PLE table: [T] -> [T, L * P]."""
        return F.embedding(text_ids, self.embed_tokens_per_layer.weight)

    def _lm_head(self, x: Tensor) -> Tensor:
        """Normed final hidden [N, H] -> logits [N, V] in the model dtype (tied embedding as LM head)."""
        return F.linear(x, self.embed_tokens.weight)

    def embed(self, input_ids: Tensor, mm_embeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """-> (h0 [T, H] with mm rows merged, text ids [T] with every MM placeholder replaced by pad)."""
        cfg = self.cfg
        mm = self.multimodal_mask(input_ids)
        placeholders = mm | (input_ids == cfg.audio_token_id)
        text_ids = torch.where(placeholders, cfg.pad_token_id, input_ids)
        scale = round_to(cfg.embed_scale, self.embed_tokens.weight.dtype)  # sqrt(H) rounded (bf16: 73.5)
        h = self._token_embeddings(text_ids) * scale  # [T, H]
        if mm_embeds is not None:
            n = int(mm.sum())
            if n != mm_embeds.shape[0]:
                raise ValueError(f"mm_embeds has {mm_embeds.shape[0]} rows for {n} image/video placeholder tokens")
            h = h.masked_scatter(mm[:, None], mm_embeds.to(h.dtype))
        return h, text_ids

    def per_layer_inputs(self, text_ids: Tensor, h0: Tensor) -> Tensor:
        """PLE (§2.3) -> [T, L, P]: (RMSNorm(h0 @ Wproj.T / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)."""
        cfg = self.cfg
        T, L, P = h0.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        scale = round_to(P**0.5, self.embed_tokens_per_layer.weight.dtype)
        tok = (self._per_layer_token_embeddings(text_ids) * scale).view(T, L, P)
        proj = (self.per_layer_model_projection(h0) * cfg.hidden_size**-0.5).view(T, L, P)
        proj = self.per_layer_projection_norm(proj)
        return (proj + tok) * 2.0**-0.5

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionBackend,
        mm_embeds: Tensor | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """input_ids/positions [T] long -> float32 logits [len(logits_indices) or T, V]."""
        h, text_ids = self.embed(input_ids, mm_embeds)  # [T, H]
        ple = self.per_layer_inputs(text_ids, h) if self.cfg.has_ple else None  # [T, L, P]
        rope = self._rope(positions)  # {is_sliding: (cos, sin) [T, hd/2]}
        for i, layer in enumerate(self.layers):
            h = layer(h, rope[layer.is_sliding], attn, None if ple is None else ple[:, i])
        if logits_indices is not None:
            h = h[logits_indices]
        return self.logits(h)

    def logits(self, h: Tensor) -> Tensor:
        """[N, H] final hidden -> float32 soft-capped logits [N, V] (tied embedding as LM head)."""
        logits = self._lm_head(self.norm(h)).float()
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
