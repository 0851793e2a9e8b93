"""Gemma4 vision tower vs HF transformers (oracle), synthetic images, presets, weight loading.

Parity tolerance: float32, max |ours - HF| <= 1e-4 on soft tokens (observed ~1e-6; differences come only
from summation order in pooling / SDPA).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_random import randomize_parameters_

from perfkit.runtime.vision import (
    SOFT_TOKEN_BUDGETS,
    VISION_PRESETS,
    Gemma4VisionTower,
    build_vision_tower,
    hf_vision_names,
    image_position_ids,
    load_vision_weights,
    num_soft_tokens,
    soft_token_grid,
    synthetic_images,
    vision_config_for,
    vision_config_from_hf,
    vision_config_to_hf,
)

gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
from transformers.models.gemma4.configuration_gemma4 import (  # noqa: E402
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

TEXT_HIDDEN = 48
ATOL = 1e-4


def _hf_vision_config(cfg, attn="sdpa") -> Gemma4VisionConfig:
    kw = {k: v for k, v in vision_config_to_hf(cfg).items() if k != "model_type"}
    hcfg = Gemma4VisionConfig(**kw)
    hcfg._attn_implementation = attn
    return hcfg


@torch.no_grad()
def _randomize_hf(vision, embed, seed: int) -> None:
    """Random weights everywhere, incl. non-trivial norms, finite clip ranges that bind, standardize."""
    g = torch.Generator().manual_seed(seed)
    randomize_parameters_(list(vision.named_parameters()) + list(embed.named_parameters()), g)
    for name, b in vision.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "input_min":
            b.fill_(-1.5)
        elif leaf == "input_max":
            b.fill_(2.0)
        elif leaf == "output_min":
            b.fill_(-1.0)
        elif leaf == "output_max":
            b.fill_(0.8)
        elif leaf == "std_bias":
            b.copy_(torch.randn(b.shape, generator=g))
        elif leaf == "std_scale":
            b.copy_(1.0 + 0.3 * torch.rand(b.shape, generator=g))


def _hf_pair(cfg, seed=0, attn="sdpa"):
    hcfg = _hf_vision_config(cfg, attn)
    vision = gemma4.Gemma4VisionModel(hcfg).eval()
    embed = gemma4.Gemma4MultimodalEmbedder(hcfg, Gemma4TextConfig(hidden_size=TEXT_HIDDEN)).eval()
    _randomize_hf(vision, embed, seed)
    state = {f"model.vision_tower.{k}": v for k, v in vision.state_dict().items()}
    state |= {f"model.embed_vision.{k}": v for k, v in embed.state_dict().items()}
    return vision, embed, state


@torch.no_grad()
def _hf_soft_tokens(vision, embed, pixel_values, pos):
    return embed(vision(pixel_values=pixel_values, pixel_position_ids=pos).last_hidden_state)


def _padded_batch(cfg):
    """Two images of a 70-token budget: one full 7x10 grid, one 5x9 grid padded with (-1, -1) like HF."""
    pv, pos = synthetic_images(2, 70, seed=3)
    k = cfg.pooling_kernel_size
    n_small = 5 * 9 * k * k
    pos[1] = -1
    pos[1, :n_small] = image_position_ids(5 * k, 9 * k)
    pv[1, n_small:] = 0.0
    return pv, pos


CONFIGS = {
    "tiny": VISION_PRESETS["tiny"],  # standardize + clipped linears
    "tiny-plain": dataclasses.replace(VISION_PRESETS["tiny"], standardize=False, use_clipped_linears=False),
    "tiny-gqa": dataclasses.replace(VISION_PRESETS["tiny"], num_key_value_heads=2, head_dim=24),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_soft_tokens_match_hf(name, padded, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = CONFIGS[name]
    vision, embed, state = _hf_pair(cfg, seed=1)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    tower = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.float32, init=False)
    with safe_open(str(path), framework="pt") as f:
        read = load_vision_weights(tower, f.get_tensor)
    assert sorted(read) == sorted(state)  # 1:1 name mapping, nothing left over

    pv, pos = _padded_batch(cfg) if padded else synthetic_images(2, 70, seed=7)
    ref = _hf_soft_tokens(vision, embed, pv, pos)
    with torch.no_grad():
        ours = tower(pv, pos)
        ours_vision = tower.encode(pv, pos)
    expected_n = 70 + (45 if padded else 70)
    assert ours.shape == ref.shape == (expected_n, TEXT_HIDDEN)
    assert sum(num_soft_tokens(pos)) == expected_n
    assert (ours - ref).abs().max().item() <= ATOL
    ref_vision = vision(pixel_values=pv, pixel_position_ids=pos).last_hidden_state
    assert (ours_vision - ref_vision).abs().max().item() <= ATOL
    assert ref.abs().max() > 0.1  # not a trivially-zero comparison


def test_matches_hf_eager_attention():
    cfg = VISION_PRESETS["tiny"]
    vision, embed, state = _hf_pair(cfg, seed=2, attn="eager")
    tower = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.float32, init=False)
    load_vision_weights(tower, state)
    pv, pos = _padded_batch(cfg)
    with torch.no_grad():
        assert (tower(pv, pos) - _hf_soft_tokens(vision, embed, pv, pos)).abs().max().item() <= ATOL


def test_bf16_close_to_hf_bf16():
    cfg = CONFIGS["tiny-plain"]
    vision, embed, state = _hf_pair(cfg, seed=4)
    vision, embed = vision.to(torch.bfloat16), embed.to(torch.bfloat16)
    tower = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.bfloat16, init=False)
    load_vision_weights(tower, state)
    pv, pos = synthetic_images(1, 70, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        ours = tower(pv, pos).float()
        ref = _hf_soft_tokens(vision, embed, pv, pos).float()
    assert ours.dtype == torch.float32 and tower.dtype == torch.bfloat16
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 2e-2


def test_hf_name_mapping_documented_prefixes():
    tower = build_vision_tower(VISION_PRESETS["tiny"], TEXT_HIDDEN, "meta", torch.float32, init=False)
    names = hf_vision_names(tower)
    assert names["embed_vision.embedding_projection.weight"] == "model.embed_vision.embedding_projection.weight"
    assert names["std_bias"] == "model.vision_tower.std_bias"
    assert names["encoder.layers.1.mlp.down_proj.linear.weight"] == (
        "model.vision_tower.encoder.layers.1.mlp.down_proj.linear.weight")


def test_load_reports_missing_and_bad_shapes():
    cfg = VISION_PRESETS["tiny"]
    _, _, state = _hf_pair(cfg)
    tower = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.float32, init=False)
    partial = dict(state)
    partial.pop("model.vision_tower.std_scale")
    with pytest.raises(KeyError, match="missing"):
        load_vision_weights(tower, partial)
    bad = dict(state)
    bad["model.embed_vision.embedding_projection.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        load_vision_weights(tower, bad)


def test_random_init_seeded_and_materialised():
    cfg = VISION_PRESETS["tiny"]
    a = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.float32, seed=11)
    b = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.float32, seed=11)
    c = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.float32, seed=12)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(not t.is_meta for t in sa.values())
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["patch_embedder.input_proj.weight"], sc["patch_embedder.input_proj.weight"])
    assert torch.all(sa["encoder.layers.0.input_layernorm.weight"] == 1)
    pv, pos = synthetic_images(2, 70, seed=0)
    with torch.no_grad():
        out = a(pv, pos)
    assert out.shape == (140, TEXT_HIDDEN) and torch.isfinite(out).all()
    bf = build_vision_tower(cfg, TEXT_HIDDEN, "cpu", torch.bfloat16, seed=11)
    assert {t.dtype for t in bf.state_dict().values()} == {torch.bfloat16}


def test_presets_and_text_mapping():
    large, on_device = VISION_PRESETS["large"], VISION_PRESETS["on_device"]
    assert (large.hidden_size, large.intermediate_size, large.num_hidden_layers, large.num_attention_heads,
            large.head_dim, large.standardize, large.use_clipped_linears) == (1152, 4304, 27, 16, 72, True, False)
    assert (on_device.hidden_size, on_device.intermediate_size, on_device.num_hidden_layers,
            on_device.num_attention_heads, on_device.head_dim, on_device.standardize,
            on_device.use_clipped_linears) == (768, 3072, 16, 12, 64, False, True)
    assert vision_config_for("e2b") is on_device and vision_config_for("e4b") is on_device
    assert vision_config_for("26b-a4b") is large and vision_config_for("31b") is large
    for name in ("tiny", "tiny-e2b", "tiny-moe", "tiny-31b"):
        assert vision_config_for(name) is VISION_PRESETS["tiny"]
    with pytest.raises(ValueError):
        vision_config_for("12b")
    # HF default vision config is the on-device shape (without clipping); round trip through HF's class
    hf_default = Gemma4VisionConfig().to_dict()
    assert dataclasses.replace(vision_config_from_hf(hf_default), use_clipped_linears=True, name="on_device") == on_device
    for cfg in VISION_PRESETS.values():
        assert vision_config_from_hf(_hf_vision_config(cfg).to_dict(), name=cfg.name) == cfg
    # large tower parameter count ~550M per reference/gemma4.md
    with torch.device("meta"):
        n = sum(p.numel() for p in Gemma4VisionTower(large, 5376).parameters())
    assert 0.52e9 < n < 0.58e9


@pytest.mark.parametrize("budget", SOFT_TOKEN_BUDGETS)
def test_patch_counts_match_hf_image_processor(budget):
    np = pytest.importorskip("numpy")
    pil = pytest.importorskip("PIL.Image")
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    rows, cols = soft_token_grid(budget)
    assert rows * cols == budget and rows <= cols <= 1.5 * rows
    pv, pos = synthetic_images(1, budget, seed=0)
    assert pv.shape == (1, budget * 9, 768) and pos.shape == (1, budget * 9, 2)
    assert num_soft_tokens(pos) == [budget]
    # an RGB image of that aspect goes through HF's processor to the same patch grid and position layout
    side = 48
    img = pil.fromarray(np.random.default_rng(0).integers(0, 255, (rows * side, cols * side, 3), dtype=np.uint8))
    out = Gemma4ImageProcessorPil(max_soft_tokens=budget)(img, return_tensors="pt")
    assert out["pixel_values"].shape == pv.shape
    assert torch.equal(out["image_position_ids"], pos)
    assert out["num_soft_tokens_per_image"].tolist() == [budget]


def test_synthetic_images_deterministic_and_distinct():
    pv1, pos1 = synthetic_images(3, 70, seed=5)
    pv2, pos2 = synthetic_images(3, 70, seed=5)
    assert torch.equal(pv1, pv2) and torch.equal(pos1, pos2)
    assert pv1.dtype == torch.float32 and pos1.dtype == torch.long
    assert 0.0 <= pv1.min() and pv1.max() < 1.0
    for i in range(3):
        for j in range(i + 1, 3):
            assert (pv1[i] == pv1[j]).float().mean() < 1e-3
    pv3, _ = synthetic_images(3, 70, seed=6)
    assert torch.equal(pv3[0], pv1[1])  # image i is seeded with seed + i, independent of batch size
    assert not torch.equal(pv3[2], pv1[2])
    pvb, _ = synthetic_images(1, 70, seed=5, dtype=torch.bfloat16)
    assert pvb.dtype == torch.bfloat16 and torch.equal(pvb[0], pv1[0].to(torch.bfloat16))
    with pytest.raises(ValueError):
        synthetic_images(1, 100)
