"""Reference paged attention (CPU and GPU): write K/V into pages, gather each request's live pages back, build an
explicit mask, run SDPA per request with scale 1.0 and GQA by repeat. Slow and obviously correct.
`kv_write_target` hands the model the cache and the step's slots so a fused kernel can write K/V itself (then
`attend(layer, q, None, None)` only attends); `write_layer_kv` and `kv_write_target` are shared with FlashInfer.

Mask per request, on the kv as the kernel sees it (live pages only, length kv_len, queries at kv positions
kv_len - q_len + i): causal AND (window band `qpos - j < W` on sliding layers). On sliding layers of bidirectional
models, prefill requests use the step's custom mask (gemma4.md §4.4/§4.5: prefix columns True, new columns
causal-or-same-blob) AND-ed with the window band, exactly as FlashInfer ANDs `window_left` with a custom mask.

FP8 KV (cache dtype float8_e4m3fn): `write_kv` stores clamp(x / scale, +-448) in e4m3 (the cache layer's fixed
k/v scales, kv_cache.KVScales); `attend` dequantises the gathered pages (float(stored) * scale, cast to q's
dtype) before SDPA. This is the CPU reference of FlashInfer's fp8 KV path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfkit.kernels.fp8 import FP8_DTYPE, dequantize_fp8_per_tensor, quantize_fp8_per_tensor
from perfkit.runtime.attention.base import AttnLayer
from perfkit.runtime.kv_cache import PagedKVCache
from perfkit.runtime.page_table import AttentionMetadata


def write_kv(
    cache: torch.Tensor, slot_page: torch.Tensor, slot_offset: torch.Tensor, k, v,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:  # fmt: skip
    """Scatter new K/V rows [T, kvh, hd] into a [num_pages, 2, page_size, kvh, hd] cache (graph-capturable).
    An fp8 cache gets clamp(x / scale) in e4m3, written through a uint8 view (index_put on bytes works on every
    device); other dtypes ignore the scales."""
    if cache.dtype == FP8_DTYPE:
        raw = cache.view(torch.uint8)
        raw[:, 0][slot_page, slot_offset] = quantize_fp8_per_tensor(k, k_scale).view(torch.uint8)
        raw[:, 1][slot_page, slot_offset] = quantize_fp8_per_tensor(v, v_scale).view(torch.uint8)
        return
    cache[:, 0][slot_page, slot_offset] = k.to(cache.dtype)
    cache[:, 1][slot_page, slot_offset] = v.to(cache.dtype)


def write_layer_kv(
    kv: PagedKVCache, meta: AttentionMetadata, layer: AttnLayer, k, v
) -> tuple[torch.Tensor, str, float, float]:
    """What every backend's `attend` does first: find this layer's cache, pool and K/V scales, and write the step's
    new K/V rows. KV-shared layers write nothing; k = v = None on a layer that writes KV means the caller already
    wrote them (into `kv_write_target`). Returns (cache, pool, k_scale, v_scale)."""
    cache = kv.layer_cache(layer.index)
    pool = kv.pool_of(layer.index)
    k_scale, v_scale = kv.layer_scales(layer.index)
    if layer.writes_kv and k is not None:
        assert v is not None, "k given without v"
        pt = meta.pools[pool]
        write_kv(cache, pt.slot_page, pt.slot_offset, k, v, k_scale, v_scale)
    return cache, pool, k_scale, v_scale


def kv_write_target(
    kv: PagedKVCache, meta: AttentionMetadata, layer: AttnLayer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
    """Both backends' `kv_write_target`: (this layer's cache, slot_page, slot_offset of its pool in the current
    step's metadata, k_scale, v_scale), or None on KV-shared layers. The caller writes K/V at
    cache[slot_page[t], 0 / 1, slot_offset[t]] (an fp8 cache: quantised as `write_kv` does, with the scales) and
    then calls attend(layer, q, None, None)."""
    if not layer.writes_kv:
        return None
    pt = meta.pools[kv.pool_of(layer.index)]
    return (kv.layer_cache(layer.index), pt.slot_page, pt.slot_offset, *kv.layer_scales(layer.index))


def read_kv(pages: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K or V rows in `dtype`: fp8 pages dequantised (float(stored) * scale), others cast."""
    if pages.dtype == FP8_DTYPE:
        return dequantize_fp8_per_tensor(pages, scale, dtype)
    return pages.to(dtype)


def reference_gemma_mask(token_type_ids, seq_lens, prefix_lens, sliding_window, impl: str = "dense") -> torch.Tensor:
    """Flat concat over requests of bool [Q_r, P_r + Q_r] (gemma4.md §4.5). Prefix columns True; new columns:
    (i - j < W) AND (j <= i OR (i, j in the same vision blob)). Fallback when perfkit.kernels.gemma_mask is absent."""
    from perfkit.runtime.scheduler import blob_bounds

    types = torch.as_tensor(token_type_ids).cpu()
    out = []
    off = 0
    for q, p in zip([int(x) for x in seq_lens], [int(x) for x in prefix_lens], strict=True):
        t = types[off : off + q]
        off += q
        start, _ = blob_bounds(t.tolist())
        blob = torch.as_tensor(start)
        i = torch.arange(q)[:, None]
        j = torch.arange(q)[None, :]
        new = (j <= i) | ((blob[:, None] >= 0) & (blob[:, None] == blob[None, :]))
        if sliding_window is not None:
            new &= (i - j) < sliding_window
        out.append(torch.cat([torch.ones(q, p, dtype=torch.bool), new], dim=1).reshape(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def request_mask(q_len: int, kv_len: int, window: int | None, custom: torch.Tensor | None, device) -> torch.Tensor:
    """bool [q_len, kv_len]: (custom or causal) AND window band, in kernel-visible kv positions."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kpos = torch.arange(kv_len, device=device)[None, :]
    allowed = custom.view(q_len, kv_len) if custom is not None else kpos <= qpos
    if window is not None:
        allowed = allowed & ((qpos - kpos) < window)
    return allowed


class TorchPagedBackend:
    name = "torch"
    supports_cuda_graphs = False

    def __init__(self, kv_cache: PagedKVCache):
        self.kv = kv_cache
        self.meta: AttentionMetadata | None = None
        self._prep: dict[tuple[str, bool], list] = {}

    def set_metadata(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._prep = {}

    def _requests(self, pool: str, bidir: bool, window: int | None, device) -> list:
        """Per request: (q_start, q_end, live pages [device], kv_len, mask [q, kv]); cached per step."""
        key = (pool, bidir)
        if key not in self._prep:
            meta = self.meta
            pt = meta.pools[pool]
            qo = meta.qo_indptr.tolist()
            ind = pt.indptr.tolist()
            kv_lens = pt.kv_lens.tolist()
            use_custom = bidir and meta.custom_mask is not None
            mask_off = 0
            reqs = []
            for r in range(meta.batch_size):
                q_len, kv_len = qo[r + 1] - qo[r], kv_lens[r]
                custom = None
                if use_custom and r >= meta.num_decodes:
                    custom = meta.custom_mask[mask_off : mask_off + q_len * kv_len].to(device)
                    mask_off += q_len * kv_len
                mask = request_mask(q_len, kv_len, window, custom, device)
                reqs.append((qo[r], qo[r + 1], pt.indices[ind[r] : ind[r + 1]].long(), kv_len, mask))
            self._prep[key] = reqs
        return self._prep[key]

    def kv_write_target(self, layer: AttnLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
        return kv_write_target(self.kv, self.meta, layer)

    def attend(self, layer: AttnLayer, q: torch.Tensor, k, v) -> torch.Tensor:
        cache, pool, k_scale, v_scale = write_layer_kv(self.kv, self.meta, layer, k, v)
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        for qs, qe, pages, kv_len, mask in self._requests(pool, layer.bidirectional_vision, layer.window, q.device):
            kr = read_kv(cache[pages, 0].reshape(-1, layer.num_kv_heads, layer.head_dim)[:kv_len], k_scale, q.dtype)
            vr = read_kv(cache[pages, 1].reshape(-1, layer.num_kv_heads, layer.head_dim)[:kv_len], v_scale, q.dtype)
            kr = kr.transpose(0, 1).repeat_interleave(group, dim=0)
            vr = vr.transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), kr, vr, attn_mask=mask, scale=1.0)
            out[qs:qe] = o.transpose(0, 1)
        return out
