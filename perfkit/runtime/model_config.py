"""Gemma4 model configuration: presets, HF config.json conversion, parameter counts.

Numbers follow shared/reference/gemma4.md §1 (text decoder); the vision tower config is vision.py's. Field names follow HF's
`Gemma4TextConfig` where one exists; `bidirectional_vision` stands for `use_bidirectional_attention == "vision"`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from perfkit.errors import PerfkitError
from perfkit.runtime.attention.base import AttnLayer
from perfkit.runtime.vision import VisionConfig, vision_config_for, vision_config_from_hf, vision_config_to_hf

SLIDING = "sliding_attention"
FULL = "full_attention"

PRESET_NAMES = ("e2b", "e4b", "26b-a4b", "31b", "tiny", "tiny-31b", "tiny-moe", "tiny-e2b", "tiny-e4b")


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma4 text decoder (+ optional vision tower) configuration. Frozen; derive variants with `replace`."""

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int  # sliding layers (and full layers unless attention_k_eq_v + global kv heads)
    num_global_key_value_heads: int | None = None
    head_dim: int = 256  # sliding layers
    global_head_dim: int = 512  # full layers
    sliding_window: int = 512
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0  # PLE width; 0 = no PLE
    vocab_size_per_layer_input: int = 0
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float = 30.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    rope_theta: float = 10_000.0  # sliding layers, default rope over the full head dim
    global_rope_theta: float = 1_000_000.0  # full layers, "proportional" rope
    global_partial_rotary_factor: float = 0.25
    bidirectional_vision: bool = False
    pad_token_id: int = 0
    eos_token_id: tuple[int, ...] = (1,)
    bos_token_id: int = 2
    image_token_id: int = 258880
    video_token_id: int = 258884
    audio_token_id: int = 258881
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    boa_token_id: int = 256000
    eoa_token_id: int = 258883
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise PerfkitError(
                f"config {self.name}: layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise PerfkitError(f"config {self.name}: unknown layer type(s) {bad}; allowed: {SLIDING}, {FULL}")
        if self.layer_types[-1] != FULL:
            raise PerfkitError(f"config {self.name}: the last layer must be {FULL}")
        if self.num_kv_shared_layers:
            owners = set(self.layer_types[: self.first_kv_shared_layer])
            if owners != set(self.layer_types):
                raise PerfkitError(
                    f"config {self.name}: num_kv_shared_layers={self.num_kv_shared_layers} leaves no cache-owning "
                    "layer for every layer type"
                )
        for tid in self.special_token_ids():
            if not 0 <= tid < self.vocab_size:
                raise PerfkitError(f"config {self.name}: special token id {tid} outside vocab {self.vocab_size}")

    # ---- per-layer helpers -----------------------------------------------------------------------------------
    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def has_ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def is_kv_shared(self, i: int) -> bool:
        return i >= self.first_kv_shared_layer

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def layer_kv_heads(self, i: int) -> int:
        if not self.is_sliding(i) and self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(i)

    def layer_intermediate_size(self, i: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.is_kv_shared(i) else 1)

    def cache_layer(self, i: int) -> int:
        """Layer whose KV layer i reads: itself, or (KV-shared) the last cache-owning layer of the same type."""
        if not self.is_kv_shared(i):
            return i
        first = self.first_kv_shared_layer
        return max(j for j in range(first) if self.layer_types[j] == self.layer_types[i])

    def attn_layers(self) -> list[AttnLayer]:
        return [
            AttnLayer(
                index=i,
                is_sliding=self.is_sliding(i),
                head_dim=self.layer_head_dim(i),
                num_heads=self.num_attention_heads,
                num_kv_heads=self.layer_kv_heads(i),
                window=self.sliding_window if self.is_sliding(i) else None,
                cache_layer=self.cache_layer(i),
                writes_kv=not self.is_kv_shared(i),
                bidirectional_vision=self.bidirectional_vision and self.is_sliding(i),
            )
            for i in range(self.num_hidden_layers)
        ]

    def special_token_ids(self) -> tuple[int, ...]:
        return (
            self.pad_token_id,
            self.bos_token_id,
            *self.eos_token_id,
            self.image_token_id,
            self.video_token_id,
            self.audio_token_id,
            self.boi_token_id,
            self.eoi_token_id,
            self.boa_token_id,
            self.eoa_token_id,
        )

    def replace(self, **changes: Any) -> Gemma4Config:
        return dataclasses.replace(self, **changes)


# ---- presets ---------------------------------------------------------------------------------------------------
def _pattern(num_layers: int, period: int) -> tuple[str, ...]:
    """(period-1) sliding + 1 full, repeated; the last layer is forced full (HF rule)."""
    types = [FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]
    types[-1] = FULL
    return tuple(types)


# Tiny configs: vocab 512 with every special / multimodal id inside it.
_TINY_TOKENS: dict[str, Any] = dict(
    vocab_size=512, pad_token_id=0, eos_token_id=(1,), bos_token_id=2, boi_token_id=500, eoi_token_id=501,
    image_token_id=502, video_token_id=503, audio_token_id=504, boa_token_id=505, eoa_token_id=506,
    max_position_embeddings=4096,
)  # fmt: skip


def _build_presets() -> dict[str, Gemma4Config]:
    e2b = Gemma4Config(
        name="e2b", vocab_size=262144, hidden_size=1536, num_hidden_layers=35, layer_types=_pattern(35, 5),
        intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1, sliding_window=512,
        num_kv_shared_layers=20, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, max_position_embeddings=131072, eos_token_id=(1, 106),
        vision=vision_config_for("e2b"),
    )  # fmt: skip
    e4b = Gemma4Config(
        name="e4b", vocab_size=262144, hidden_size=2560, num_hidden_layers=42, layer_types=_pattern(42, 6),
        intermediate_size=10240, num_attention_heads=8, num_key_value_heads=2, sliding_window=512,
        num_kv_shared_layers=18, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
        max_position_embeddings=131072, eos_token_id=(1, 106), vision=vision_config_for("e2b"),
    )  # fmt: skip
    moe = Gemma4Config(
        name="26b-a4b", vocab_size=262144, hidden_size=2816, num_hidden_layers=30, layer_types=_pattern(30, 6),
        intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
        attention_k_eq_v=True, sliding_window=1024, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704, max_position_embeddings=262144, bidirectional_vision=True,
        eos_token_id=(1, 106), vision=vision_config_for("31b"),
    )  # fmt: skip
    dense = Gemma4Config(
        name="31b", vocab_size=262144, hidden_size=5376, num_hidden_layers=60, layer_types=_pattern(60, 6),
        intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
        attention_k_eq_v=True, sliding_window=1024, max_position_embeddings=262144, bidirectional_vision=True,
        eos_token_id=(1, 106), vision=vision_config_for("31b"),
    )  # fmt: skip
    tiny_small = dict(hidden_size=64, num_attention_heads=4, head_dim=32, global_head_dim=64, sliding_window=8)
    tiny = Gemma4Config(
        name="tiny", num_hidden_layers=6, layer_types=_pattern(6, 6), intermediate_size=128,
        num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True, bidirectional_vision=True,
        vision=vision_config_for("tiny"), **tiny_small, **_TINY_TOKENS,
    )  # fmt: skip
    tiny_moe = Gemma4Config(
        name="tiny-moe", num_hidden_layers=6, layer_types=_pattern(6, 6), intermediate_size=64,
        num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=16, top_k_experts=4, moe_intermediate_size=32, bidirectional_vision=True,
        vision=vision_config_for("tiny"), **tiny_small, **_TINY_TOKENS,
    )  # fmt: skip
    tiny_e2b = Gemma4Config(
        name="tiny-e2b", num_hidden_layers=10, layer_types=_pattern(10, 5), intermediate_size=96,
        num_key_value_heads=1, num_kv_shared_layers=4, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512, vision=vision_config_for("tiny"), **tiny_small, **_TINY_TOKENS,
    )  # fmt: skip
    tiny_e4b = Gemma4Config(
        name="tiny-e4b", num_hidden_layers=12, layer_types=_pattern(12, 6), intermediate_size=128,
        num_key_value_heads=2, num_kv_shared_layers=4, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512, vision=vision_config_for("tiny"), **tiny_small, **_TINY_TOKENS,
    )  # fmt: skip
    return {
        "e2b": e2b, "e4b": e4b, "26b-a4b": moe, "31b": dense, "tiny": tiny, "tiny-31b": tiny.replace(name="tiny-31b"),
        "tiny-moe": tiny_moe, "tiny-e2b": tiny_e2b, "tiny-e4b": tiny_e4b,
    }  # fmt: skip


def get_preset(name: str, num_layers: int | None = None) -> Gemma4Config:
    """A preset by name; `num_layers` truncates while keeping the sliding/full pattern (last layer full)."""
    presets = _build_presets()
    if name not in presets:
        raise PerfkitError(f"unknown model preset {name!r}; allowed: {', '.join(PRESET_NAMES)}")
    cfg = presets[name]
    if num_layers is None or num_layers == cfg.num_hidden_layers:
        return cfg
    return truncate_layers(cfg, num_layers)


def truncate_layers(cfg: Gemma4Config, num_layers: int) -> Gemma4Config:
    """First `num_layers` layers of `cfg`'s pattern with the last forced full; KV sharing scaled down."""
    if num_layers < 1:
        raise PerfkitError(f"num_layers must be >= 1, got {num_layers}")
    types = list(cfg.layer_types[:num_layers])
    if num_layers > cfg.num_hidden_layers:  # extend the periodic pattern
        period = cfg.layer_types.index(FULL) + 1
        types = list(_pattern(num_layers, period))
    types[-1] = FULL
    shared = 0
    if cfg.num_kv_shared_layers:
        shared = round(cfg.num_kv_shared_layers * num_layers / cfg.num_hidden_layers)
        while shared > 0 and set(types[: num_layers - shared]) != set(types):
            shared -= 1
    return cfg.replace(
        name=f"{cfg.name}@{num_layers}L", num_hidden_layers=num_layers, layer_types=tuple(types),
        num_kv_shared_layers=shared,
    )  # fmt: skip


# ---- HF config.json conversion ---------------------------------------------------------------------------------
def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)


def from_hf_config(d: dict[str, Any], name: str = "hf") -> Gemma4Config:
    """Gemma4Config from an HF config.json dict: top-level `gemma4` (with text_config) or text-only `gemma4_text`."""
    top = d
    text = d.get("text_config") or d
    if text.get("model_type", "gemma4_text") not in ("gemma4_text", "gemma4"):
        raise PerfkitError(f"config.json: model_type {text.get('model_type')!r} is not a Gemma4 text model")
    n = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types") or list(_pattern(n, 6))
    layer_types = list(layer_types)
    layer_types[-1] = FULL
    head_dim = int(text.get("head_dim", 256))
    global_head_dim = text.get("global_head_dim")
    num_global_kv = text.get("num_global_key_value_heads")
    # transformers >= 5.2x serializes the full-layer overrides as per_layer_config {idx: {head_dim, kv heads}}
    for idx, over in (text.get("per_layer_config") or {}).items():
        if layer_types[int(idx)] == FULL:
            global_head_dim = over.get("head_dim", global_head_dim)
            num_global_kv = over.get("num_key_value_heads", num_global_kv)
    rope = text.get("rope_parameters") or {}
    rope_s = rope.get(SLIDING) or {}
    rope_f = rope.get(FULL) or {}
    if rope_f.get("rope_type", "proportional") != "proportional" or rope_s.get("rope_type", "default") != "default":
        raise PerfkitError(f"config.json: unsupported rope_parameters {rope}")
    bidir = text.get("use_bidirectional_attention")
    if bidir == "all":
        raise PerfkitError('config.json: use_bidirectional_attention="all" is not supported')

    def tok(key: str, default: int) -> int:
        v = top.get(key, text.get(key))
        return default if v is None else int(v)

    vision = vision_config_from_hf(d["vision_config"]) if d.get("vision_config") else None
    ple = int(text.get("hidden_size_per_layer_input") or 0)
    moe = bool(text.get("enable_moe_block", False))
    return Gemma4Config(
        name=name,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=n,
        layer_types=tuple(layer_types),
        intermediate_size=int(text["intermediate_size"]),
        num_attention_heads=int(text["num_attention_heads"]),
        num_key_value_heads=int(text["num_key_value_heads"]),
        num_global_key_value_heads=None if num_global_kv is None else int(num_global_kv),
        head_dim=head_dim,
        global_head_dim=int(global_head_dim or 512),
        sliding_window=int(text.get("sliding_window", 512)),
        attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
        num_kv_shared_layers=int(text.get("num_kv_shared_layers") or 0),
        use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(text.get("vocab_size_per_layer_input") or 0) if ple else 0,
        enable_moe_block=moe,
        num_experts=int(text.get("num_experts") or 0) if moe else 0,
        top_k_experts=int(text.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe else 0,
        final_logit_softcapping=float(text.get("final_logit_softcapping") or 0.0),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        hidden_activation=str(text.get("hidden_activation", "gelu_pytorch_tanh")),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        rope_theta=float(rope_s.get("rope_theta", 10_000.0)),
        global_rope_theta=float(rope_f.get("rope_theta", 1_000_000.0)),
        global_partial_rotary_factor=float(rope_f.get("partial_rotary_factor", 0.25)),
        bidirectional_vision=bidir == "vision",
        pad_token_id=tok("pad_token_id", 0),
        eos_token_id=_as_tuple(top.get("eos_token_id", text.get("eos_token_id", 1))),
        bos_token_id=tok("bos_token_id", 2),
        image_token_id=tok("image_token_id", 258880),
        video_token_id=tok("video_token_id", 258884),
        audio_token_id=tok("audio_token_id", 258881),
        boi_token_id=tok("boi_token_id", 255999),
        eoi_token_id=tok("eoi_token_id", 258882),
        boa_token_id=tok("boa_token_id", 256000),
        eoa_token_id=tok("eoa_token_index", tok("eoa_token_id", 258883)),
        vision=vision,
    )


def to_hf_config(cfg: Gemma4Config, multimodal: bool = False) -> dict[str, Any]:
    """HF config dict. Default: a `gemma4_text` dict (`transformers.Gemma4TextConfig(**d)` -> Gemma4ForCausalLM);
    `multimodal=True`: a top-level `gemma4` dict with text_config (+ vision_config) and the multimodal token ids."""
    text: dict[str, Any] = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_global_key_value_heads": cfg.num_global_key_value_heads,
        "head_dim": cfg.head_dim,
        "global_head_dim": cfg.global_head_dim,
        "hidden_activation": cfg.hidden_activation,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "pad_token_id": cfg.pad_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0],
        "bos_token_id": cfg.bos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_theta},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": cfg.global_partial_rotary_factor,
                "rope_theta": cfg.global_rope_theta,
            },
        },
        "attention_bias": False,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "final_logit_softcapping": cfg.final_logit_softcapping or None,
        "use_bidirectional_attention": "vision" if cfg.bidirectional_vision else None,
        "vocab_size_per_layer_input": cfg.vocab_size_per_layer_input or cfg.vocab_size,
        "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input,
        "attention_k_eq_v": cfg.attention_k_eq_v,
        "num_kv_shared_layers": cfg.num_kv_shared_layers,
        "enable_moe_block": cfg.enable_moe_block,
        "use_double_wide_mlp": cfg.use_double_wide_mlp,
        "num_experts": cfg.num_experts or None,
        "top_k_experts": cfg.top_k_experts or None,
        "moe_intermediate_size": cfg.moe_intermediate_size or None,
    }
    # multimodal token ids ride along in the text dict too (extra attributes for HF; keeps tiny vocabs consistent)
    text.update(
        image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id, audio_token_id=cfg.audio_token_id,
        boi_token_id=cfg.boi_token_id, eoi_token_id=cfg.eoi_token_id, boa_token_id=cfg.boa_token_id,
        eoa_token_index=cfg.eoa_token_id,
    )  # fmt: skip
    if not multimodal:
        return text
    out: dict[str, Any] = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "boi_token_id": cfg.boi_token_id,
        "eoi_token_id": cfg.eoi_token_id,
        "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id,
        "boa_token_id": cfg.boa_token_id,
        "eoa_token_index": cfg.eoa_token_id,
        "audio_token_id": cfg.audio_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if cfg.vision is not None:
        out["vision_config"] = vision_config_to_hf(cfg.vision)
    return out


# ---- parameter counts ------------------------------------------------------------------------------------------
class ParamCount(NamedTuple):
    total: int  # every text-decoder parameter (vision/audio towers excluded)
    active: int  # per token: MoE layers count only top_k experts
    embedding: int  # embed_tokens (+ PLE table embed_tokens_per_layer)


@dataclass(frozen=True)
class _LayerParams:
    attention: int
    mlp: int
    experts_all: int = 0
    experts_active: int = 0
    other: int = field(default=0)


def _layer_params(cfg: Gemma4Config, i: int) -> _LayerParams:
    H, hd, nh, kvh = cfg.hidden_size, cfg.layer_head_dim(i), cfg.num_attention_heads, cfg.layer_kv_heads(i)
    attn = 2 * nh * hd * H + hd  # q_proj, o_proj, q_norm
    if not cfg.is_kv_shared(i):
        attn += kvh * hd * H + hd  # k_proj, k_norm
        if not cfg.layer_k_eq_v(i):
            attn += kvh * hd * H  # v_proj
    mlp = 3 * H * cfg.layer_intermediate_size(i)
    other = 4 * H + 1  # 4 norms + layer_scalar
    if cfg.has_ple:
        other += 2 * H * cfg.hidden_size_per_layer_input + H
    ex_all = ex_act = 0
    if cfg.enable_moe_block:
        E, K, Im = cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size
        other += E * H + H + E + 3 * H  # router proj/scale/per_expert_scale, 3 extra norms
        ex_all, ex_act = E * 3 * Im * H, K * 3 * Im * H
    return _LayerParams(attn, mlp, ex_all, ex_act, other)


def param_count(cfg: Gemma4Config) -> ParamCount:
    """Exact text-decoder parameter counts from the shapes (tied lm_head counted once)."""
    H, L, P = cfg.hidden_size, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
    embedding = cfg.vocab_size * H
    model_other = H  # final norm
    if cfg.has_ple:
        embedding += cfg.vocab_size_per_layer_input * L * P
        model_other += L * P * H + P  # per_layer_model_projection, per_layer_projection_norm
    if not cfg.tie_word_embeddings:
        model_other += cfg.vocab_size * H
    total = active = embedding + model_other
    for i in range(L):
        lp = _layer_params(cfg, i)
        base = lp.attention + lp.mlp + lp.other
        total += base + lp.experts_all
        active += base + lp.experts_active
    return ParamCount(total=total, active=active, embedding=embedding)
