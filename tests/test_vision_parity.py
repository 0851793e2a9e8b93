"""Multimodal end-to-end parity: perfkit text decoder + vision tower vs HF Gemma4ForConditionalGeneration.

A tiny HF model (perfkit's `tiny` preset: dense, K=V full layers, sliding window 8, bidirectional vision on
sliding layers, tiny vision tower) gets random weights everywhere (norms, layer scalars, clip ranges and
standardize buffers included), is written with `save_pretrained`, and perfkit loads config + text + vision
from that directory. The prompt holds two images laid out as `boi + N x image_token + eoi` (N = 70 > window,
so the window-inside-blob case is exercised too; HF and perfkit both apply the window after OR-ing the blob).
Tolerance: float32 logits, max |diff| <= 1e-3 (observed ~1e-5).
"""

from __future__ import annotations

import pytest
import torch
from hf_random import randomize_parameters_

from perfkit.runtime.attention.contiguous import ContiguousAttention
from perfkit.runtime.model_config import get_preset, to_hf_config
from perfkit.runtime.vision import build_vision_tower, load_vision_weights, synthetic_images
from perfkit.runtime.weights import build_model, load_hf_state

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4.configuration_gemma4 import Gemma4Config as HFGemma4Config  # noqa: E402
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForConditionalGeneration  # noqa: E402

ATOL = 1e-3
SOFT = 70


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    randomize_parameters_(model.named_parameters(), g)
    for name, b in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "layer_scalar":
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
        elif leaf in ("input_min", "output_min"):
            b.fill_(-1.5)
        elif leaf in ("input_max", "output_max"):
            b.fill_(1.5)
        elif leaf == "std_bias":
            b.copy_(torch.randn(b.shape, generator=g))
        elif leaf == "std_scale":
            b.copy_(1.0 + 0.3 * torch.rand(b.shape, generator=g))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = get_preset("tiny")
    d = to_hf_config(cfg, multimodal=True)
    hf_cfg = HFGemma4Config(text_config=d["text_config"], vision_config=d["vision_config"], audio_config=None,
                            **{k: v for k, v in d.items() if k.endswith("_id") or k == "eoa_token_index"})
    hf_cfg._attn_implementation = "eager"
    hf_cfg.get_text_config()._attn_implementation = "eager"
    hf_cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(hf_cfg).eval()
    _randomize(model, seed=0)
    path = tmp_path_factory.mktemp("hf_gemma4_mm")
    model.save_pretrained(path)
    return path, model


def _load_perfkit(path):
    """The integration path: config + text weights via weights.build_model, vision via load_vision_weights."""
    state = load_hf_state(path)
    model = build_model(None, "cpu", torch.float32, weights="hf", path=path)
    cfg = model.cfg
    assert cfg.vision is not None and cfg.bidirectional_vision
    tower = build_vision_tower(cfg.vision, cfg.hidden_size, "cpu", torch.float32, init=False)
    read = load_vision_weights(tower, state)
    text = {state.text_name(n) for n in model.state_dict()}
    assert set(read) | text == set(state)  # every checkpoint tensor has exactly one home
    return cfg, model, tower


def _prompt(cfg, n_images: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bos, text, (boi + SOFT x image + eoi + text) per image -> input_ids [T], token_type_ids [T]."""
    ids = [cfg.bos_token_id, 10, 11, 12]
    for i in range(n_images):
        ids += [cfg.boi_token_id] + [cfg.image_token_id] * SOFT + [cfg.eoi_token_id] + [20 + i, 30 + i]
    input_ids = torch.tensor(ids)
    return input_ids, (input_ids == cfg.image_token_id).long()


def test_multimodal_logits_match_hf(hf_dir):
    path, hf = hf_dir
    cfg, model, tower = _load_perfkit(path)
    pv, pos = synthetic_images(2, SOFT, seed=123)
    input_ids, types = _prompt(cfg, 2)
    with torch.no_grad():
        ref = hf(input_ids=input_ids[None], pixel_values=pv, image_position_ids=pos,
                 mm_token_type_ids=types[None]).logits[0].float()
        mm = tower(pv, pos)
        attn = ContiguousAttention()
        attn.prepare(input_ids.numel(), types)
        ours = model(input_ids, torch.arange(input_ids.numel()), attn, mm_embeds=mm)
    assert mm.shape == (2 * SOFT, cfg.hidden_size)
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, diff
    # the vision rule matters here: causal-only attention gives different logits
    with torch.no_grad():
        causal = ContiguousAttention()
        causal.prepare(input_ids.numel())
        plain = model(input_ids, torch.arange(input_ids.numel()), causal, mm_embeds=mm)
    assert (plain - ref).abs().max().item() > 100 * ATOL


def test_chunked_prefill_aligned_to_blobs_matches_hf(hf_dir):
    path, hf = hf_dir
    cfg, model, tower = _load_perfkit(path)
    pv, pos = synthetic_images(2, SOFT, seed=7)
    input_ids, types = _prompt(cfg, 2)
    split = 4 + SOFT + 2 + 2  # after image 1 and its trailing text: blob 2 lies wholly in chunk 2
    with torch.no_grad():
        ref = hf(input_ids=input_ids[None], pixel_values=pv, image_position_ids=pos,
                 mm_token_type_ids=types[None]).logits[0].float()
        mm = tower(pv, pos)
        attn = ContiguousAttention()
        outs = []
        for lo, hi in ((0, split), (split, input_ids.numel())):
            chunk = input_ids[lo:hi]
            n_mm_before = int((input_ids[:lo] == cfg.image_token_id).sum())
            n_mm = int((chunk == cfg.image_token_id).sum())
            attn.prepare(hi - lo, types[lo:hi])
            outs.append(model(chunk, torch.arange(lo, hi), attn, mm_embeds=mm[n_mm_before:n_mm_before + n_mm]))
    ours = torch.cat(outs)
    assert (ours - ref).abs().max().item() <= ATOL
