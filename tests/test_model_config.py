"""Gemma4 presets, HF config round trip, per-layer structure and parameter counts."""

from __future__ import annotations

import dataclasses

import pytest

from perfkit.errors import PerfkitError
from perfkit.runtime.model_config import (
    FULL,
    PRESET_NAMES,
    SLIDING,
    from_hf_config,
    get_preset,
    param_count,
    to_hf_config,
)

# Published totals (shared/reference/gemma4.md §1.1): text decoder incl. embeddings and PLE tables.
PUBLISHED_TOTAL_B = {"31b": 30.7, "26b-a4b": 25.2, "e2b": 4.63, "e4b": 7.46}


@pytest.mark.parametrize("name", list(PUBLISHED_TOTAL_B))
def test_param_count_matches_published(name):
    pc = param_count(get_preset(name))
    assert abs(pc.total / 1e9 - PUBLISHED_TOTAL_B[name]) / PUBLISHED_TOTAL_B[name] < 0.01


def test_moe_active_params():
    pc = param_count(get_preset("26b-a4b"))
    assert abs(pc.active / 1e9 - 3.8) / 3.8 < 0.01  # 3.08 B non-embedding + 0.74 B embedding
    assert pc.embedding == 262144 * 2816
    dense = param_count(get_preset("31b"))
    assert dense.active == dense.total


def test_param_count_matches_module_shapes():
    import torch

    from perfkit.runtime.model import Gemma4ForCausalLM

    for name in ("tiny", "tiny-moe", "tiny-e2b", "tiny-e4b"):
        cfg = get_preset(name)
        model = Gemma4ForCausalLM(cfg, device="meta", dtype=torch.bfloat16)
        n = sum(t.numel() for t in model.state_dict().values())
        assert param_count(cfg).total == n, name


def test_layer_structure_of_public_presets():
    e2b, e4b, moe, dense = (get_preset(n) for n in ("e2b", "e4b", "26b-a4b", "31b"))
    assert [i for i, t in enumerate(e2b.layer_types) if t == FULL] == list(range(4, 35, 5))
    assert [i for i, t in enumerate(dense.layer_types) if t == FULL] == list(range(5, 60, 6))
    layers = e2b.attn_layers()
    assert {layer.cache_layer for layer in layers[15:] if layer.is_sliding} == {13}
    assert {layer.cache_layer for layer in layers[15:] if not layer.is_sliding} == {14}
    assert not any(layer.writes_kv for layer in layers[15:]) and all(layer.writes_kv for layer in layers[:15])
    assert e2b.layer_intermediate_size(15) == 12288 and e2b.layer_intermediate_size(14) == 6144
    layers = e4b.attn_layers()
    assert {layer.cache_layer for layer in layers[24:]} == {22, 23}
    assert layers[5].num_kv_heads == 2 and layers[5].head_dim == 512  # E2B/E4B full layers keep kv heads
    full = moe.attn_layers()[5]
    assert (full.head_dim, full.num_kv_heads, full.window, full.bidirectional_vision) == (512, 2, None, False)
    sliding = dense.attn_layers()[0]
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.window, sliding.bidirectional_vision) == (
        256,
        16,
        1024,
        True,
    )
    assert not e2b.attn_layers()[0].bidirectional_vision


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_truncation_keeps_pattern(name):
    cfg = get_preset(name, num_layers=2)
    assert cfg.layer_types == (SLIDING, FULL)
    assert cfg.num_kv_shared_layers == 0
    cfg.attn_layers()
    assert get_preset(name, num_layers=7).layer_types[-1] == FULL


def test_tiny_token_ids_inside_vocab():
    for name in PRESET_NAMES:
        cfg = get_preset(name)
        assert all(0 <= t < cfg.vocab_size for t in cfg.special_token_ids())
        if name.startswith("tiny"):
            assert cfg.vocab_size == 512


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("multimodal", [False, True])
def test_hf_config_round_trip(name, multimodal):
    cfg = get_preset(name)
    back = from_hf_config(to_hf_config(cfg, multimodal=multimodal), name=cfg.name)
    if not multimodal:  # text-only dicts carry no vision tower
        cfg = dataclasses.replace(cfg, vision=None)
    else:
        back = dataclasses.replace(back, vision=cfg.vision)
    assert back == cfg


def test_hf_config_accepts_transformers_serialisation():
    transformers = pytest.importorskip("transformers")
    cfg = get_preset("tiny-moe")
    d = transformers.Gemma4TextConfig(**to_hf_config(cfg)).to_dict()  # per_layer_config instead of global_*
    assert from_hf_config(d, name=cfg.name) == dataclasses.replace(cfg, vision=None)


def test_unknown_preset_is_a_user_error():
    with pytest.raises(PerfkitError, match="unknown model preset 'nope'"):
        get_preset("nope")


def test_real_shape_rope_and_embed_scale():
    import torch

    from perfkit.runtime.model import rope_inv_freq, round_to

    full = rope_inv_freq(get_preset("31b"), sliding=False)
    assert full.shape == (256,) and int((full > 0).sum()) == 64  # 64 live frequencies, pairing d <-> d+256
    assert full[1].item() == pytest.approx(1e6 ** (-2 / 512))  # denominator = full head dim 512
    sliding = rope_inv_freq(get_preset("31b"), sliding=True)
    assert sliding.shape == (128,) and sliding[1].item() == pytest.approx(1e4 ** (-2 / 256))
    assert [round_to(get_preset(n).embed_scale, torch.bfloat16) for n in ("e2b", "e4b", "26b-a4b", "31b")] == [
        39.25,
        50.5,
        53.0,
        73.5,
    ]
