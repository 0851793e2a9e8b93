"""Attention interface shared by the model and every attention backend (see docs/contracts.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class AttnLayer:
    """Static description of one decoder layer's attention, as a backend needs it."""

    index: int  # decoder layer index
    is_sliding: bool
    head_dim: int  # 256 sliding, 512 full
    num_heads: int
    num_kv_heads: int  # per layer type (full layers may use num_global_key_value_heads)
    window: int | None  # sliding_window on sliding layers, None on full layers
    cache_layer: int  # layer whose KV this layer reads (itself unless KV-shared)
    writes_kv: bool  # False on KV-shared layers
    bidirectional_vision: bool  # sliding layers of models with use_bidirectional_attention == "vision"


class AttentionBackend(Protocol):
    def attend(self, layer: AttnLayer, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        """q [T, num_heads, hd] (normed + roped); k [T, kvh, hd] (normed + roped) and v [T, kvh, hd] (v_norm'd)
        or None on KV-shared layers. Writes k/v into its cache (if writes_kv), attends with scale 1.0,
        returns [T, num_heads, hd]. Per-step metadata lives inside the backend object, set by the engine
        before the forward; never in module globals."""
        ...
