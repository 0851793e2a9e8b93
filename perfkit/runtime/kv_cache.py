"""Paged KV cache: one pool per layer group (sliding / full), one tensor per cache-owning layer.

Layout per cache layer (FlashInfer NHD): `[num_pages, 2, page_size, kv_heads, head_dim]`, index 0 on dim 1 is K,
1 is V. K and V share strides (no FlashInfer "independent stride" module). Page 0 of every pool is reserved as
the dummy page that CUDA-graph padding requests point at; the block manager never hands it out.
KV-shared layers own no tensor: they read the tensor of `layer.cache_layer`.

Sizing: `plan_kv_pages` turns a byte budget (measured free memory x kv_cache_fraction, computed by the caller)
into pages per pool using `bytes_per_page` (element size of the KV dtype: 1 byte for fp8, so ~2x the pages of bf16).

FP8 KV (dtype float8_e4m3fn): one fixed scale per cache layer for K and one for V (`KVScales`). Pages hold
`clamp(x / scale, +-448)` in e4m3; attention reads `float(stored) * scale` (the torch backend dequantises the
gathered pages, FlashInfer takes `k_scale`/`v_scale` in run()). Scales never change after the cache is built
(a stored value is only meaningful with the scale it was divided by). Random weights have no calibration data,
so the scale is the bound RMSNorm puts on K and V (`rmsnorm_bound_kv_scales`): y = x / rms(x) * w has
sum_i (y_i / w_i)^2 <= hd, so |y_i| <= sqrt(hd) * max|w|; RoPE rotates pairs (|rotated| <= norm of the pair <=
sqrt(hd) * max|w|), and v_norm has no weight (|v_i| <= sqrt(hd)). scale = bound / 448 therefore never saturates
(up to the bf16 rounding of the bound itself; the clamp covers that), and since e4m3 is a float format its ~2^-4
relative rounding error does not depend on the scale while values stay above the subnormal range
(|x| > bound / 448 * 2^-6, i.e. ~6e-4 for hd 256 with unit weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from perfkit.errors import PerfkitError
from perfkit.kernels.fp8 import FP8_DTYPE, FP8_MAX
from perfkit.runtime.attention.base import AttnLayer

SLIDING_POOL = "sliding"
FULL_POOL = "full"
DUMMY_PAGE = 0


@dataclass(frozen=True)
class PoolSpec:
    """One layer group sharing head_dim, kv heads, window and therefore page tables."""

    name: str  # "sliding" | "full"
    head_dim: int
    num_kv_heads: int
    num_heads: int
    window: int | None  # tokens incl. self (key j visible to query i iff i - W < j <= i); None = full
    cache_layers: tuple[int, ...]  # layers that write KV (own a tensor in this pool)


def pool_name(layer: AttnLayer) -> str:
    return SLIDING_POOL if layer.is_sliding else FULL_POOL


def pool_specs(layers: list[AttnLayer]) -> dict[str, PoolSpec]:
    """Group the cache-owning layers by type. Every layer of one type must agree on shapes and window."""
    specs: dict[str, PoolSpec] = {}
    for name in (SLIDING_POOL, FULL_POOL):
        group = [la for la in layers if pool_name(la) == name]
        if not group:
            continue
        shapes = {(la.head_dim, la.num_kv_heads, la.num_heads, la.window) for la in group}
        if len(shapes) != 1:
            raise PerfkitError(f"{name} layers disagree on (head_dim, kv_heads, heads, window): {sorted(shapes)}")
        hd, kvh, nh, window = shapes.pop()
        owners = tuple(la.index for la in group if la.writes_kv)
        specs[name] = PoolSpec(name, hd, kvh, nh, window, owners)
    return specs


@dataclass(frozen=True)
class KVScales:
    """FP8 KV scales per cache layer (K and V separately): stored = clamp(x / scale), read = stored * scale."""

    k: dict[int, float]
    v: dict[int, float]
    method: str  # "rmsnorm_bound" | "unit"

    def summary(self) -> dict:
        """What a result records (`runtime.kv_scales`): the method and min/max over cache layers."""
        return {
            "method": self.method, "layers": len(self.k),
            "k_min": min(self.k.values(), default=None), "k_max": max(self.k.values(), default=None),
            "v_min": min(self.v.values(), default=None), "v_max": max(self.v.values(), default=None),
        }  # fmt: skip


def unit_kv_scales(layers: list[AttnLayer]) -> KVScales:
    owners = [la.index for la in layers if la.writes_kv]
    return KVScales(dict.fromkeys(owners, 1.0), dict.fromkeys(owners, 1.0), "unit")


def rmsnorm_bound_kv_scales(layers: list[AttnLayer], k_norm_amax: dict[int, float]) -> KVScales:
    """Scales from the RMSNorm bound (module docstring): K: sqrt(hd) * max|k_norm.weight| / 448, V: sqrt(hd) / 448.
    `k_norm_amax`: cache layer -> max |k_norm weight| (1.0 for a norm without weight)."""
    k, v = {}, {}
    for la in layers:
        if la.writes_kv:
            bound = math.sqrt(la.head_dim)
            k[la.index] = max(bound * float(k_norm_amax[la.index]), 1e-6) / FP8_MAX
            v[la.index] = bound / FP8_MAX
    return KVScales(k, v, "rmsnorm_bound")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_page(spec: PoolSpec, page_size: int, dtype: torch.dtype) -> int:
    """K+V bytes of one page across every cache layer of the pool."""
    return 2 * page_size * spec.num_kv_heads * spec.head_dim * dtype_bytes(dtype) * len(spec.cache_layers)


def max_sliding_pages(window: int, page_size: int, max_batch_size: int, max_num_tokens: int) -> int:
    """Pages a sliding pool can ever need at once (so it never runs out before the full pool).

    A request at context L scheduling q new tokens holds pages covering [L - W + 1, L + q): at most
    ceil((W - 1 + q) / page_size) + 1 pages. Summed over the batch with sum(q) <= max_num_tokens this is at most
    max_batch_size * (ceil((W - 1) / page_size) + 2) + ceil(max_num_tokens / page_size), plus the dummy page.
    """
    per_req = math.ceil((window - 1) / page_size) + 2
    return max_batch_size * per_req + math.ceil(max_num_tokens / page_size) + 1


@dataclass(frozen=True)
class KVPlan:
    page_size: int
    num_pages: dict[str, int]  # per pool, including the dummy page
    bytes_per_page: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.num_pages[p] * self.bytes_per_page[p] for p in self.num_pages)


def plan_kv_pages(
    free_bytes: int,
    fraction: float,
    cfg,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    max_batch_size: int | None = None,
    max_num_tokens: int | None = None,
) -> KVPlan:
    """Pages per pool for a budget of `free_bytes * fraction`.

    With `max_batch_size` and `max_num_tokens` known, the sliding pool gets exactly what it can ever use
    (`max_sliding_pages`, capped by the budget share) and the full pool the rest. Without them both pools get the
    same page count (equal token capacity), the conservative split.
    """
    budget = int(free_bytes * fraction)
    specs = pool_specs(cfg.attn_layers())
    bpp = {name: bytes_per_page(s, page_size, dtype) for name, s in specs.items()}
    if budget <= 0:
        raise PerfkitError(f"KV cache budget is {budget} bytes (free {free_bytes} x fraction {fraction})")
    pages: dict[str, int] = {}
    if len(specs) == 2 and max_batch_size is not None and max_num_tokens is not None:
        win = specs[SLIDING_POOL].window or 0
        equal = budget // (bpp[SLIDING_POOL] + bpp[FULL_POOL])
        pages[SLIDING_POOL] = min(max_sliding_pages(win, page_size, max_batch_size, max_num_tokens), equal)
        pages[FULL_POOL] = (budget - pages[SLIDING_POOL] * bpp[SLIDING_POOL]) // bpp[FULL_POOL]
    else:
        n = budget // sum(bpp.values())
        pages = {name: n for name in specs}
    for name, n in pages.items():
        if n < 2:
            raise PerfkitError(
                f"KV cache budget {budget / 2**30:.3f} GiB gives {n} pages for the {name} pool "
                f"({bpp[name]} bytes per page); raise kv_cache_fraction or free memory"
            )
    return KVPlan(page_size, pages, bpp)


class PagedKVCache:
    """Device tensors of every pool. `layer_cache(layer)` is the tensor a layer writes/reads, `layer_scales(layer)`
    its (k_scale, v_scale): 1.0 unless the dtype is fp8 (then `scales`, default unit scales)."""

    def __init__(
        self, layers: list[AttnLayer], num_pages: dict[str, int], page_size: int, dtype, device,
        scales: KVScales | None = None,
    ):  # fmt: skip
        self.specs = pool_specs(layers)
        self.page_size = page_size
        self.dtype = dtype
        self.is_fp8 = dtype == FP8_DTYPE
        self.scales = (scales or unit_kv_scales(layers)) if self.is_fp8 else None
        self.device = torch.device(device)
        self.num_pages = dict(num_pages)
        self._tensors: dict[int, torch.Tensor] = {}
        for name, spec in self.specs.items():
            for li in spec.cache_layers:
                self._tensors[li] = torch.zeros(
                    (num_pages[name], 2, page_size, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device
                )
        self._pool_of = {la.index: pool_name(la) for la in layers}
        self._cache_of = {la.index: la.cache_layer for la in layers}

    def layer_cache(self, layer_index: int) -> torch.Tensor:
        return self._tensors[self._cache_of[layer_index]]

    def layer_scales(self, layer_index: int) -> tuple[float, float]:
        """(k_scale, v_scale) of the cache this layer reads (KV-shared layers: their cache layer's)."""
        if self.scales is None:
            return 1.0, 1.0
        li = self._cache_of[layer_index]
        return self.scales.k[li], self.scales.v[li]

    def pool_of(self, layer_index: int) -> str:
        return self._pool_of[layer_index]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def pool_bytes(self) -> dict[str, int]:
        out = dict.fromkeys(self.specs, 0)
        for li, t in self._tensors.items():
            out[self._pool_of[li]] += t.numel() * t.element_size()
        return out
