"""Gemma4 vision tower: pixels (patchified) -> soft tokens in the text model's hidden space.

Pipeline (``reference/gemma4.md`` §4.1), per image of ``P`` patches (16x16x3 = 768 values each):

1. ``patch_embedder``: ``input_proj(2*(pixel-0.5))`` + learned 2-D position table (x row + y row), padding
   patches get no position embedding.
2. ``encoder``: ``num_hidden_layers`` sandwich-norm blocks; bidirectional attention over the patches of one
   image (padding keys masked), scale 1.0, q/k RMSNorm with weight, v RMSNorm without weight, 2-D RoPE
   theta=100 (first half of each head rotated by the x coordinate, second half by y), gelu-tanh gated MLP.
3. ``pooler`` (no parameters): average over k x k (k=3) patch neighbourhoods by (x, y) position, then
   ``* sqrt(hidden)`` in float32; pooled slots that received no real patch (padding) are dropped.
4. optional standardize ``(h - std_bias) * std_scale`` (large tower only), cast back to the working dtype.
5. ``embed_vision``: RMSNorm without weight, then ``Linear(hidden -> text hidden, no bias)``.

Inputs use the HF image-processor layout: ``pixel_values [num_images, max_patches, 3*16*16]`` (each patch
flattened as (row, col, channel), values in [0, 1]) and ``pixel_position_ids [num_images, max_patches, 2]``
holding (x, y) patch coordinates, ``(-1, -1)`` for padding. ``forward`` returns ``[n_soft_total,
text_hidden]`` (all images' soft tokens concatenated in order), exactly what HF's
``Gemma4Model.get_image_features`` yields before splitting per image.

HF checkpoint name mapping (1:1, only a prefix changes; the module tree mirrors HF's):

    model.vision_tower.<rest>  ->  <rest>
        patch_embedder.input_proj.weight, patch_embedder.position_embedding_table,
        encoder.layers.{i}.self_attn.{q,k,v,o}_proj.linear.weight,
        encoder.layers.{i}.self_attn.{q,k,v,o}_proj.{input,output}_{min,max}   (clipped linears only),
        encoder.layers.{i}.self_attn.{q,k}_norm.weight,
        encoder.layers.{i}.mlp.{gate,up,down}_proj.linear.weight (+ clip buffers),
        encoder.layers.{i}.{input,post_attention,pre_feedforward,post_feedforward}_layernorm.weight,
        std_bias, std_scale                                                     (standardize only)
    model.embed_vision.<rest>  ->  embed_vision.<rest>
        embed_vision.embedding_projection.weight

HF's non-persistent ``encoder.rotary_emb.inv_freq`` buffers are recomputed here, never loaded.
For a stand-alone ``Gemma4VisionModel`` / ``Gemma4MultimodalEmbedder`` state dict pass
``vision_prefix=""`` / ``embed_prefix=...`` to :func:`load_vision_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionConfig:
    """Gemma4 vision tower shape. Field names follow HF ``Gemma4VisionConfig``."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    use_clipped_linears: bool
    standardize: bool
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim must be divisible by 4 (2-D RoPE), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported vision activation {self.hidden_activation!r}")

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    @property
    def patches_per_soft_token(self) -> int:
        return self.pooling_kernel_size**2


VISION_PRESETS: dict[str, VisionConfig] = {
    # 26B-A4B / 31B
    "large": VisionConfig(
        name="large", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, head_dim=72, use_clipped_linears=False, standardize=True,
    ),
    # E2B / E4B
    "on_device": VisionConfig(
        name="on_device", hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
        num_key_value_heads=12, head_dim=64, use_clipped_linears=True, standardize=False,
    ),
    # tests: exercises standardize and clipped linears at once; 128 positions cover a 1120-token image (105 px)
    "tiny": VisionConfig(
        name="tiny", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, use_clipped_linears=True, standardize=True,
        position_embedding_size=128,
    ),
}


def get_vision_preset(name: str) -> VisionConfig:
    try:
        return VISION_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown vision preset {name!r}; allowed: {', '.join(VISION_PRESETS)}") from None


def vision_config_for(text_preset_name: str) -> VisionConfig:
    """The vision tower that ships with a text preset: e2b/e4b -> on_device, 26b-a4b/31b -> large, tiny* -> tiny."""
    name = text_preset_name.lower()
    if name.startswith("tiny"):
        return VISION_PRESETS["tiny"]
    if name in ("e2b", "e4b"):
        return VISION_PRESETS["on_device"]
    if name in ("26b-a4b", "31b"):
        return VISION_PRESETS["large"]
    raise ValueError(f"no vision tower known for text preset {text_preset_name!r}")


_HF_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "use_clipped_linears", "standardize", "patch_size", "pooling_kernel_size",
    "position_embedding_size", "rms_norm_eps", "hidden_activation",
)


def vision_config_from_hf(d: Mapping, name: str = "hf") -> VisionConfig:
    """HF ``vision_config`` dict (config.json) -> :class:`VisionConfig`."""
    defaults = {f.name: f.default for f in fields(VisionConfig)}
    kw = {k: d.get(k, defaults.get(k)) for k in _HF_FIELDS}
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type must be 'axial', got {rope.get('rope_type')!r}")
    kw["rope_theta"] = float(rope.get("rope_theta", 100.0))
    if kw["head_dim"] is None:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    return VisionConfig(name=name, **kw)


def vision_config_to_hf(cfg: VisionConfig) -> dict:
    """:class:`VisionConfig` -> kwargs for HF ``Gemma4VisionConfig`` (``model_type`` included)."""
    d = {k: getattr(cfg, k) for k in _HF_FIELDS}
    d["rope_parameters"] = {"rope_type": "axial", "rope_theta": cfg.rope_theta}
    d["model_type"] = "gemma4_vision"
    return d


# ----------------------------------------------------------------------------------------------------------
# Modules (names mirror HF so state dicts map 1:1)
# ----------------------------------------------------------------------------------------------------------
def _rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Gemma4 RMSNorm: float32 math, ``x * (mean(x^2) + eps)^-0.5 * w`` (no ``1 + w``), cast back."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        return _rms_norm(x, self.weight, self.eps)


class ClippableLinear(nn.Module):
    """``linear`` (no bias), optionally clamping its input and output to checkpoint-provided ranges."""

    def __init__(self, in_features: int, out_features: int, clipped: bool, device=None, dtype=None):
        super().__init__()
        self.clipped = clipped
        self.linear = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
        if clipped:
            for n, v in (("input_min", -math.inf), ("input_max", math.inf),
                         ("output_min", -math.inf), ("output_max", math.inf)):
                self.register_buffer(n, torch.tensor(v, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        self.input_proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False, device=device, dtype=dtype)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, cfg.position_embedding_size, cfg.hidden_size, device=device, dtype=dtype))

    def forward(self, pixel_values: Tensor, pos: Tensor, pad: Tensor) -> Tensor:
        w = self.input_proj.weight
        h = self.input_proj((2 * (pixel_values - 0.5)).to(w.dtype))
        pos = pos.clamp(min=0)
        pe = F.embedding(pos[..., 0], self.position_embedding_table[0]) + F.embedding(
            pos[..., 1], self.position_embedding_table[1])
        pe = pe.masked_fill(pad.unsqueeze(-1), 0.0)
        return h + pe


def _rope_2d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, P, H, hd]; cos/sin [B, P, 1, hd] laid out (x, x, y, y) in quarters. Rotate-half within each half."""
    q = x.shape[-1] // 4
    xr = x.unflatten(-1, (2, 2, q))  # (axis, half, freq)
    rot = torch.stack((-xr[..., 1, :], xr[..., 0, :]), dim=-2).flatten(-3)
    return x * cos + rot * sin


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        hd, nh, kvh, hid = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        c = cfg.use_clipped_linears
        self.head_dim, self.num_heads, self.num_kv_heads = hd, nh, kvh
        self.q_proj = ClippableLinear(hid, nh * hd, c, device, dtype)
        self.k_proj = ClippableLinear(hid, kvh * hd, c, device, dtype)
        self.v_proj = ClippableLinear(hid, kvh * hd, c, device, dtype)
        self.o_proj = ClippableLinear(nh * hd, hid, c, device, dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.v_norm = RMSNorm(hd, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None) -> Tensor:
        B, P, _ = x.shape
        q = _rope_2d(self.q_norm(self.q_proj(x).view(B, P, self.num_heads, self.head_dim)), cos, sin)
        k = _rope_2d(self.k_norm(self.k_proj(x).view(B, P, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(B, P, self.num_kv_heads, self.head_dim))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=1.0,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, P, self.num_heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        c, hid, inter = cfg.use_clipped_linears, cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ClippableLinear(hid, inter, c, device, dtype)
        self.up_proj = ClippableLinear(hid, inter, c, device, dtype)
        self.down_proj = ClippableLinear(inter, hid, c, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        hid, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = VisionAttention(cfg, device, dtype)
        self.mlp = VisionMLP(cfg, device, dtype)
        self.input_layernorm = RMSNorm(hid, eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hid, eps, device=device, dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(hid, eps, device=device, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(hid, eps, device=device, dtype=dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn_mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, device, dtype) for _ in range(cfg.num_hidden_layers))

    def rope_tables(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """pos [B, P, 2] (clamped) -> cos, sin [B, P, 1, hd] in ``dtype``, quarters (x, x, y, y)."""
        spatial = self.cfg.head_dim // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float, device=pos.device) / spatial))
        ang = pos.float()[..., None] * inv_freq  # [B, P, 2, hd/4]
        ang = torch.cat((ang[..., 0, :], ang[..., 0, :], ang[..., 1, :], ang[..., 1, :]), dim=-1).unsqueeze(2)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, x: Tensor, pos: Tensor, pad: Tensor, has_padding: bool) -> Tensor:
        cos, sin = self.rope_tables(pos, x.dtype)
        # Bool key-padding mask only when needed so unpadded batches keep the flash / cuDNN SDPA paths.
        attn_mask = (~pad)[:, None, None, :] if has_padding else None
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return x


class VisionPooler(nn.Module):
    """k x k average pooling by patch position + sqrt(hidden) scaling (float32). No parameters.

    Deterministic scatter (no atomics): each real patch is written to slot ``(pooled index, offset in its
    k x k window)`` of a ``[B*L, k*k, hidden]`` float32 buffer, which is then summed over the window.
    Pooled index = ``x//k + (max_x//k) * (y//k)`` per image (HF's layout: row-major over the pooled grid).
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.k = cfg.pooling_kernel_size
        self.root_hidden = cfg.hidden_size**0.5

    def forward(self, h: Tensor, pos: Tensor, pad: Tensor) -> tuple[Tensor, Tensor]:
        B, P, hid = h.shape
        k, kk = self.k, self.k * self.k
        L = P // kk
        if L * kk != P:
            raise ValueError(f"patch count {P} is not a multiple of {kk} (pooling {k}x{k})")
        max_x = pos[..., 0].max(dim=-1, keepdim=True).values + 1
        slot = pos[..., 0] // k + (max_x // k) * (pos[..., 1] // k)  # [B, P]
        offset = (pos[..., 1] % k) * k + pos[..., 0] % k
        dest = (torch.arange(B, device=h.device)[:, None] * L + slot) * kk + offset
        dump = B * L * kk  # padding patches land in one extra, discarded row
        dest = torch.where(pad, dump, dest).reshape(-1)
        buf = h.new_zeros(dump + 1, hid, dtype=torch.float32)
        buf[dest] = h.reshape(-1, hid).float()
        filled = torch.zeros(dump + 1, dtype=torch.bool, device=h.device)
        filled[dest] = True
        pooled = buf[:dump].view(B * L, kk, hid).sum(1) / kk
        valid = filled[:dump].view(B * L, kk).any(1)
        # HF rounds the average to the working dtype, then scales in float32.
        return pooled.to(h.dtype).float() * self.root_hidden, valid


class MultimodalEmbedder(nn.Module):
    """``embed_vision``: RMSNorm (no weight) -> Linear(vision hidden -> text hidden, no bias)."""

    def __init__(self, hidden: int, text_hidden: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(hidden, text_hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.embedding_projection(_rms_norm(x, None, self.eps))


class Gemma4VisionTower(nn.Module):
    """Patch embedder + encoder + pooler (+ standardize) + ``embed_vision`` projector."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.text_hidden_size = text_hidden_size
        self.patch_embedder = PatchEmbedder(cfg, device, dtype)
        self.encoder = VisionEncoder(cfg, device, dtype)
        self.pooler = VisionPooler(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size, device=device, dtype=dtype))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size, device=device, dtype=dtype))
        self.embed_vision = MultimodalEmbedder(cfg.hidden_size, text_hidden_size, cfg.rms_norm_eps, device, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedder.input_proj.weight.dtype

    def encode(self, pixel_values: Tensor, pixel_position_ids: Tensor) -> Tensor:
        """Vision-space soft tokens [n_soft_total, vision_hidden] (HF ``Gemma4VisionModel`` output)."""
        if pixel_values.dim() != 3 or pixel_position_ids.shape != (*pixel_values.shape[:2], 2):
            raise ValueError(
                f"expected pixel_values [N, P, {self.cfg.patch_dim}] and pixel_position_ids [N, P, 2], got "
                f"{tuple(pixel_values.shape)} and {tuple(pixel_position_ids.shape)}")
        pos = pixel_position_ids.long()
        pad = (pos == -1).all(dim=-1)
        has_padding = bool(pad.any())  # one host sync; the output size depends on it anyway
        pos = pos.clamp(min=0)
        h = self.patch_embedder(pixel_values, pos, pad)
        h = self.encoder(h, pos, pad, has_padding)
        h = h.masked_fill(pad.unsqueeze(-1), 0.0)
        pooled, valid = self.pooler(h, pos, pad)
        out = pooled[valid]
        if self.cfg.standardize:
            out = (out - self.std_bias.float()) * self.std_scale.float()
        return out.to(h.dtype)

    def forward(self, pixel_values: Tensor, pixel_position_ids: Tensor) -> Tensor:
        """-> soft tokens [n_soft_total, text_hidden] in the tower's dtype, images concatenated in order."""
        return self.embed_vision(self.encode(pixel_values, pixel_position_ids))


# ----------------------------------------------------------------------------------------------------------
# Weights: random init and HF loading
# ----------------------------------------------------------------------------------------------------------
def build_vision_tower(cfg: VisionConfig, text_hidden_size: int, device, dtype: torch.dtype,
                       seed: int = 0, init: bool = True) -> Gemma4VisionTower:
    """Build on the meta device, materialise on ``device`` at ``dtype`` (no CPU round trip), then
    (``init=True``) fill seeded random weights. ``init=False`` leaves storage uninitialised for a loader."""
    with torch.device("meta"):
        tower = Gemma4VisionTower(cfg, text_hidden_size, dtype=dtype)
    tower = tower.to_empty(device=device)
    if init:
        init_vision_random_(tower, seed)
    return tower.eval().requires_grad_(False)


@torch.no_grad()
def init_vision_random_(tower: Gemma4VisionTower, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random init on the tower's own device: matmul weights and position table ~ N(0, std), norm
    weights 1, clip ranges +-inf, standardize identity. Same seed + device type -> same weights."""
    dev = tower.patch_embedder.input_proj.weight.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, p in sorted(tower.named_parameters()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    for name, b in tower.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("_min"):
            b.fill_(-math.inf)
        elif leaf.endswith("_max"):
            b.fill_(math.inf)
        elif leaf == "std_bias":
            b.zero_()
        elif leaf == "std_scale":
            b.fill_(1.0)


def hf_vision_names(tower: Gemma4VisionTower, vision_prefix: str = "model.vision_tower.",
                    embed_prefix: str = "model.embed_vision.") -> dict[str, str]:
    """Our state-dict name -> HF checkpoint name, for every parameter and persistent buffer of ``tower``."""
    out = {}
    for name in tower.state_dict():
        if name.startswith("embed_vision."):
            out[name] = embed_prefix + name[len("embed_vision."):]
        else:
            out[name] = vision_prefix + name
    return out


@torch.no_grad()
def load_vision_weights(tower: Gemma4VisionTower, state_getter: Callable[[str], Tensor] | Mapping[str, Tensor],
                        vision_prefix: str = "model.vision_tower.",
                        embed_prefix: str = "model.embed_vision.") -> list[str]:
    """Copy HF checkpoint tensors into ``tower`` (cast to its dtype/device). ``state_getter`` is a mapping or a
    callable ``hf_name -> Tensor`` (e.g. ``safe_open(...).get_tensor`` or ``weights.load_hf_state``'s getter).
    Every tensor of the tower must be found; returns the HF names read."""
    get = state_getter.__getitem__ if isinstance(state_getter, Mapping) else state_getter
    state = tower.state_dict(keep_vars=True)
    names = hf_vision_names(tower, vision_prefix, embed_prefix)
    missing = []
    for ours, hf in names.items():
        try:
            src = get(hf)
        except KeyError:
            missing.append(hf)
            continue
        dst = state[ours]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{hf}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
    if missing:
        raise KeyError(f"{len(missing)} vision tensors missing from checkpoint, e.g. {missing[:3]}")
    return list(names.values())


# ----------------------------------------------------------------------------------------------------------
# Synthetic images
# ----------------------------------------------------------------------------------------------------------
def soft_token_grid(soft_tokens: int) -> tuple[int, int]:
    """(rows, cols) of pooled soft tokens for the square-ish image that uses a token budget best: the largest
    ``rows*cols <= soft_tokens`` with ``rows <= cols``, ties to the squarer grid. All five Gemma4 budgets are
    filled exactly: 70 -> 7x10, 140 -> 10x14, 280 -> 14x20, 560 -> 20x28, 1120 -> 32x35. HF's image processor
    maps an image of ``rows*48 x cols*48`` px (any scale of that aspect) to exactly this grid."""
    if soft_tokens < 1:
        raise ValueError("soft_tokens must be >= 1")
    best = (0, 0, 0)
    for rows in range(1, math.isqrt(soft_tokens) + 1):
        cols = soft_tokens // rows
        cand = (rows * cols, rows, cols)  # max product, then larger rows (squarer)
        best = max(best, cand)
    return best[1], best[2]


def image_position_ids(patch_rows: int, patch_cols: int, device=None) -> Tensor:
    """(x, y) per patch in row-major patch order, as HF's image processor lays them out: [rows*cols, 2]."""
    ys, xs = torch.meshgrid(torch.arange(patch_rows, device=device), torch.arange(patch_cols, device=device),
                            indexing="ij")
    return torch.stack((xs, ys), dim=-1).reshape(-1, 2)


def synthetic_images(num_images: int, soft_tokens_per_image: int = 280, seed: int = 0, device="cpu",
                     dtype: torch.dtype = torch.float32, patch_size: int = 16,
                     pooling_kernel_size: int = 3) -> tuple[Tensor, Tensor]:
    """Random images already patchified like HF's ``Gemma4ImageProcessor`` output.

    Returns ``pixel_values [num_images, soft_tokens_per_image * k*k, 3*patch^2]`` in [0, 1) and
    ``pixel_position_ids [num_images, same, 2]`` (long; ``-1`` rows pad up to the budget like HF, none for the
    five standard budgets). Image ``i`` is drawn from a CPU ``torch.Generator`` seeded ``seed + i`` (so content
    does not depend on the device, and distinct images never repeat one another), then moved to ``device``."""
    if soft_tokens_per_image not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"soft_tokens_per_image must be one of {SOFT_TOKEN_BUDGETS}, got {soft_tokens_per_image}")
    k = pooling_kernel_size
    rows, cols = soft_token_grid(soft_tokens_per_image)
    n_real = rows * cols * k * k
    max_patches = soft_tokens_per_image * k * k
    patch_dim = 3 * patch_size * patch_size
    pos = torch.full((max_patches, 2), -1, dtype=torch.long)
    pos[:n_real] = image_position_ids(rows * k, cols * k)
    pixels = torch.zeros(num_images, max_patches, patch_dim, dtype=torch.float32)
    for i in range(num_images):
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed + i)
        pixels[i, :n_real] = torch.rand(n_real, patch_dim, generator=gen)
    return (pixels.to(device=device, dtype=dtype),
            pos.unsqueeze(0).expand(num_images, -1, -1).contiguous().to(device))


def num_soft_tokens(pixel_position_ids: Tensor, pooling_kernel_size: int = 3) -> list[int]:
    """Soft tokens each image yields (real patches / k^2), as HF's ``get_image_features`` splits them."""
    real = (pixel_position_ids != -1).all(dim=-1).sum(dim=-1)
    return (real // pooling_kernel_size**2).tolist()
