"""Reference attention backend: one sequence, one contiguous growing K/V cache per cache-owning layer.

Used by `generate` and the parity tests. Mask (shared/reference/gemma4.md §2.4, §4.4), positions absolute:
  full layers:     allow(i, j) = j <= i
  sliding layers:  allow(i, j) = (i - j < W) and (j <= i or (bidirectional_vision and same vision blob))
A vision blob is a maximal run of image/video tokens (token type 1 or 2); audio (3) and text (0) never are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from perfkit.runtime.attention.base import AttnLayer


def vision_blob_ids(token_type_ids: Tensor) -> Tensor:
    """[S] token types (0 text, 1 image, 2 video, 3 audio) -> [S] blob id per vision run, -1 elsewhere."""
    is_vision = (token_type_ids == 1) | (token_type_ids == 2)
    prev = torch.zeros_like(is_vision)
    prev[1:] = is_vision[:-1]
    starts = is_vision & ~prev
    return torch.where(is_vision, torch.cumsum(starts.long(), 0) - 1, -1)


def attention_mask(q_pos: Tensor, kv_len: int, layer: AttnLayer, blob: Tensor | None) -> Tensor:
    """Bool [T, S]: True where query at absolute position q_pos[t] may see key j (0 <= j < kv_len)."""
    j = torch.arange(kv_len, device=q_pos.device)
    i = q_pos[:, None]
    allow = j[None, :] <= i
    if layer.window is not None:
        if layer.bidirectional_vision and blob is not None:
            bq = blob[q_pos][:, None]
            allow = allow | ((bq >= 0) & (bq == blob[None, :kv_len]))
        allow = allow & (i - j[None, :] < layer.window)
    return allow


class _GrowingKV:
    """K and V [capacity, kvh, hd] with amortised doubling; `len` rows are valid."""

    def __init__(self, k: Tensor, v: Tensor):
        cap = max(64, 2 * k.shape[0])
        self.k = k.new_empty((cap, *k.shape[1:]))
        self.v = v.new_empty((cap, *v.shape[1:]))
        self.len = 0
        self.append(k, v)

    def append(self, k: Tensor, v: Tensor) -> None:
        n = self.len + k.shape[0]
        if n > self.k.shape[0]:
            cap = max(n, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty((cap, *old.shape[1:]))
                new[: self.len] = old[: self.len]
                setattr(self, name, new)
        self.k[self.len : n] = k
        self.v[self.len : n] = v
        self.len = n


class ContiguousAttention:
    """Single-sequence backend. Call `prepare(num_tokens, token_type_ids)` before every forward."""

    def __init__(self) -> None:
        self.caches: dict[int, _GrowingKV] = {}
        self.token_types: Tensor | None = None  # [S] for every token seen so far (when any were given)
        self.num_tokens = 0  # tokens in the sequence after the current step
        self._blob: Tensor | None = None

    def reset(self) -> None:
        self.__init__()

    def prepare(self, num_tokens: int, token_type_ids: Tensor | None = None, device: torch.device | None = None):
        """Declare the next forward's `num_tokens` new tokens (and their types, for the vision rule)."""
        if token_type_ids is not None or self.token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.token_types.device)
            token_type_ids = token_type_ids.to(device or token_type_ids.device, torch.long).reshape(-1)
            if token_type_ids.numel() != num_tokens:
                raise ValueError(f"token_type_ids has {token_type_ids.numel()} entries for {num_tokens} tokens")
            if self.token_types is None:  # earlier tokens were text
                prev = torch.zeros(self.num_tokens, dtype=torch.long, device=token_type_ids.device)
                token_type_ids = torch.cat([prev, token_type_ids])
            else:
                token_type_ids = torch.cat([self.token_types, token_type_ids.to(self.token_types.device)])
            self.token_types = token_type_ids
            self._blob = vision_blob_ids(token_type_ids)
        self.num_tokens += num_tokens

    def kv_write_target(self, layer: AttnLayer) -> None:
        """No paged cache to write into: the caller always hands k and v to `attend`."""
        return None

    def attend(self, layer: AttnLayer, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        # q [T, nh, hd]; k, v [T, kvh, hd] or None (KV-shared layer)
        T = q.shape[0]
        if layer.writes_kv:
            assert k is not None and v is not None
            cache = self.caches.get(layer.cache_layer)
            if cache is None:
                self.caches[layer.cache_layer] = cache = _GrowingKV(k, v)
            else:
                cache.append(k, v)
        else:
            cache = self.caches[layer.cache_layer]
        S = cache.len
        if S != self.num_tokens:
            raise RuntimeError(f"layer {layer.index}: cache holds {S} tokens, prepare() declared {self.num_tokens}")
        q_pos = torch.arange(S - T, S, device=q.device)
        mask = attention_mask(q_pos, S, layer, self._blob)  # [T, S]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [nh, T, hd]
            cache.k[:S].transpose(0, 1),  # [kvh, S, hd]
            cache.v[:S].transpose(0, 1),
            attn_mask=mask,
            scale=1.0,
            enable_gqa=True,
        )  # [nh, T, hd]
        return out.transpose(0, 1)
