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
        """q [T, num_heads, hd] (normed + roped); k [T, kvh, hd] (normed + roped) and v [T, kvh, hd] (v_norm'd).
        Writes k/v into its cache (if writes_kv), attends with scale 1.0, returns [T, num_heads, hd].
        k = v = None: on KV-shared layers (nothing to write), and on layers that write KV it means "the caller
        already wrote this step's K/V rows into the target `kv_write_target(layer)` handed out": attend only.
        Per-step metadata lives inside the backend object, set by the engine before the forward; never in
        module globals."""
        ...

    def kv_write_target(self, layer: AttnLayer) -> tuple[Tensor, Tensor, Tensor, float, float] | None:
        """Where the caller may write this step's K/V rows itself (the fused qkv kernel writes them straight into
        the paged cache, saving the backend's scatter): (cache [num_pages, 2, page_size, kvh, hd], slot_page [T],
        slot_offset [T] int64 device tensors of the current step's metadata, k_scale, v_scale). An fp8 cache
        stores clamp(x * fp8_inv_scale(scale)) in e4m3 (``write_kv``'s rule); other caches ignore the scales. None when
        the layer writes no KV or the backend has no paged cache. The caller must also check that cache.dtype
        is its K/V dtype or fp8.
        The slot tensors are those the metadata points at (CUDA graphs: static buffers refilled before every
        replay), so a kernel must read them on the device, never as host values."""
        ...
