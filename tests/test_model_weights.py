"""build_model: seeded random init, HF checkpoint errors, lazy checkpoint access; MoE expert paths agree."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from perfkit.errors import PerfkitError
from perfkit.runtime.attention.contiguous import ContiguousAttention
from perfkit.runtime.generate import greedy_generate
from perfkit.runtime.model_config import get_preset, to_hf_config
from perfkit.runtime.weights import build_model, load_hf_state


def test_random_init_is_deterministic_and_seeded():
    cfg = get_preset("tiny-moe")
    a = build_model(cfg, "cpu", torch.float32, seed=0).state_dict()
    b = build_model(cfg, "cpu", torch.float32, seed=0).state_dict()
    c = build_model(cfg, "cpu", torch.float32, seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.self_attn.q_proj.weight"], c["layers.0.self_attn.q_proj.weight"])
    assert torch.all(a["layers.0.input_layernorm.weight"] == 1) and torch.all(a["layers.3.layer_scalar"] == 1)
    assert torch.all(a["layers.0.router.per_expert_scale"] == 1)
    w = a["layers.0.mlp.gate_proj.weight"]
    assert 0.015 < w.std().item() < 0.025 and w.device.type == "cpu"


def test_random_bf16_generates():
    model = build_model(get_preset("tiny-e2b"), "cpu", torch.bfloat16, seed=0)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    toks = greedy_generate(model, [2, 10, 11, 12], 5)
    assert len(toks) == 5 and all(0 <= t < 512 for t in toks)


def _save_tiny_checkpoint(path, cfg, prefix="model."):
    import json

    model = build_model(cfg, "cpu", torch.float32, seed=0)
    tensors = {prefix + k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(to_hf_config(cfg, multimodal=prefix != "model.")))
    return model


def test_multimodal_prefix_and_foreign_tensors(tmp_path):
    cfg = get_preset("tiny")
    ref = _save_tiny_checkpoint(tmp_path, cfg, prefix="model.language_model.")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.vision_tower.patch_embedder.input_proj.weight"] = torch.zeros(32, 768)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = build_model(None, "cpu", torch.float32, weights="hf", path=tmp_path)  # config from config.json
    assert model.cfg.bidirectional_vision and model.cfg.vision is not None
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    state = load_hf_state(tmp_path)
    assert state.non_text_keys() == ["model.vision_tower.patch_embedder.input_proj.weight"]
    assert state["model.vision_tower.patch_embedder.input_proj.weight"].shape == (32, 768)


def test_missing_tensor_error_names_it(tmp_path):
    cfg = get_preset("tiny")
    _save_tiny_checkpoint(tmp_path, cfg)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PerfkitError, match=r"missing tensor .*layers\.2\.self_attn\.k_norm\.weight"):
        build_model(cfg, "cpu", torch.float32, weights="hf", path=tmp_path)


def test_misshaped_tensor_error_names_it(tmp_path):
    cfg = get_preset("tiny")
    _save_tiny_checkpoint(tmp_path, cfg)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.5.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PerfkitError, match=r"model\.layers\.5\.self_attn\.k_proj\.weight has shape \[3, 64\]"):
        build_model(cfg, "cpu", torch.float32, weights="hf", path=tmp_path)


def test_missing_checkpoint_dir_is_a_user_error(tmp_path):
    with pytest.raises(PerfkitError, match="no \\*.safetensors"):
        build_model(get_preset("tiny"), "cpu", torch.float32, weights="hf", path=tmp_path)


@torch.no_grad()
def test_moe_gather_and_sorted_paths_agree():
    model = build_model(get_preset("tiny-moe"), "cpu", torch.float32, seed=0)
    experts = model.layers[0].experts
    x = torch.randn(40, 64)
    idx = torch.stack([torch.randperm(16)[:4] for _ in range(40)])
    w = torch.rand(40, 4)
    torch.testing.assert_close(experts.forward_gather(x, idx, w), experts.forward_sorted(x, idx, w))
    # and the dispatching forward gives the same logits whichever path a step takes
    ids = torch.randint(3, 500, (30,))
    attn = ContiguousAttention()
    attn.prepare(30)
    big = model(ids, torch.arange(30), attn)  # T*K = 120 > gather_max_rows: sorted path
    experts_cls = type(experts)
    old = experts_cls.gather_max_rows
    experts_cls.gather_max_rows = 10**9
    try:
        attn = ContiguousAttention()
        attn.prepare(30)
        torch.testing.assert_close(model(ids, torch.arange(30), attn), big, atol=1e-5, rtol=1e-5)
    finally:
        experts_cls.gather_max_rows = old
