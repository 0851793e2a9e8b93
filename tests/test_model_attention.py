"""Contiguous reference attention: mask rule (causal, sliding window, bidirectional vision) and the cache."""

from __future__ import annotations

import torch

from perfkit.runtime.attention.base import AttnLayer
from perfkit.runtime.attention.contiguous import ContiguousAttention, attention_mask, vision_blob_ids


def _layer(sliding: bool, bidir: bool = False, window: int = 4, **kw) -> AttnLayer:
    base = dict(index=0, is_sliding=sliding, head_dim=8, num_heads=4, num_kv_heads=2, window=window if sliding else None,
                cache_layer=0, writes_kv=True, bidirectional_vision=bidir and sliding)  # fmt: skip
    base.update(kw)
    return AttnLayer(**base)


def _reference_mask(types: list[int], layer: AttnLayer) -> torch.Tensor:
    blob = vision_blob_ids(torch.tensor(types)).tolist()
    n = len(types)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if layer.window is None:
                out[i, j] = j <= i
            else:
                same = layer.bidirectional_vision and blob[i] >= 0 and blob[i] == blob[j]
                out[i, j] = (i - j < layer.window) and (j <= i or same)
    return out


def test_blob_ids():
    types = torch.tensor([0, 1, 1, 0, 2, 2, 3, 1, 0])
    assert vision_blob_ids(types).tolist() == [-1, 0, 0, -1, 1, 1, -1, 2, -1]


def test_mask_rules():
    types = [0, 1, 1, 1, 1, 1, 1, 0, 3, 3, 2, 2, 0]  # image blob of 6 > window 4, audio (never bidir), video
    pos = torch.arange(len(types))
    blob = vision_blob_ids(torch.tensor(types))
    for layer in (_layer(True), _layer(True, bidir=True), _layer(False), _layer(False, bidir=True)):
        got = attention_mask(pos, len(types), layer, blob)
        assert torch.equal(got, _reference_mask(types, layer)), layer
    window = attention_mask(pos, len(types), _layer(True), None)
    assert window[6].tolist() == [False, False, False, True, True, True, True] + [False] * 6
    bidir = attention_mask(pos, len(types), _layer(True, bidir=True), blob)
    assert bidir[1, 6] and not bidir[1, 7]  # the whole future blob (the window bounds only the past side)
    assert not bidir[6, 1] and bidir[6, 3]  # same blob but i - j >= W: hidden
    assert not bidir[8, 9]  # audio stays causal


def test_chunked_prefill_and_decode_match_one_shot():
    torch.manual_seed(0)
    layer = _layer(True, bidir=True, window=5)
    T = 12
    types = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    q, k, v = (torch.randn(T, n, 8) for n in (4, 2, 2))
    one = ContiguousAttention()
    one.prepare(T, types)
    ref = one.attend(layer, q, k, v)
    inc = ContiguousAttention()
    outs = []
    for s, e in ((0, 5), (5, 9), (9, 10), (10, 11), (11, 12)):
        inc.prepare(e - s, types[s:e] if s == 0 else None)
        outs.append(inc.attend(layer, q[s:e], k[s:e], v[s:e]))
    torch.testing.assert_close(torch.cat(outs), ref)
    # a KV-shared layer reads the source layer's cache
    shared = _layer(True, bidir=True, window=5, index=1, writes_kv=False)
    torch.testing.assert_close(one.attend(shared, q, None, None), ref)


def test_gqa_and_scale_one():
    torch.manual_seed(0)
    layer = _layer(False)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    attn = ContiguousAttention()
    attn.prepare(3)
    out = attn.attend(layer, q, k, v)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.einsum("thd,shd->hts", q, kr)  # scale 1.0
    s = s.masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("hts,shd->thd", s.softmax(-1), vr)
    torch.testing.assert_close(out, ref)
