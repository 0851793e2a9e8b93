"""Greedy generation for one sequence with the contiguous reference attention backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from perfkit.runtime.attention.contiguous import ContiguousAttention
from perfkit.runtime.model import Gemma4ForCausalLM


def token_types_from_ids(model: Gemma4ForCausalLM, ids: Tensor) -> Tensor:
    """[T] token types as HF's processor assigns them: 0 text, 1 image, 2 video, 3 audio placeholder."""
    cfg = model.cfg
    types = torch.zeros_like(ids)
    types[ids == cfg.image_token_id] = 1
    types[ids == cfg.video_token_id] = 2
    types[ids == cfg.audio_token_id] = 3
    return types


@torch.no_grad()
def greedy_generate(
    model: Gemma4ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    mm_embeds: Tensor | None = None,
    token_type_ids: Sequence[int] | Tensor | None = None,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """Prefill the prompt, then one token per step (argmax). Returns only the new token ids. Never stops at EOS
    unless `stop_token_ids` is given. `token_type_ids` default: derived from the placeholder ids in the prompt."""
    device = model.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    T = ids.numel()
    if T == 0:
        raise ValueError("prompt_ids is empty")
    types = token_types_from_ids(model, ids) if token_type_ids is None else torch.as_tensor(token_type_ids)
    model.ensure_rope(T + max_new_tokens)
    attn = ContiguousAttention()
    attn.prepare(T, types.to(device))
    logits = model(
        ids, torch.arange(T, device=device), attn, mm_embeds=mm_embeds, logits_indices=ids.new_tensor([T - 1])
    )
    out: list[int] = []
    for step in range(max_new_tokens):
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok in stop_token_ids or step == max_new_tokens - 1:
            break
        attn.prepare(1)
        logits = model(ids.new_tensor([tok]), ids.new_tensor([T + step]), attn)
    return out


def load_for_generate(
    model: str, device: str = "cpu", dtype: str = "float32", seed: int = 0, num_layers: int | None = None
) -> Gemma4ForCausalLM:
    """`model` = preset name (random weights) or an HF checkpoint directory. Used by `perfkit generate`."""
    from pathlib import Path

    from perfkit.errors import PerfkitError
    from perfkit.runtime.model_config import PRESET_NAMES, from_hf_config, get_preset, truncate_layers
    from perfkit.runtime.weights import build_model, load_hf_state

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise PerfkitError(f"--dtype {dtype!r}: allowed values are {', '.join(dtypes)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PerfkitError(f"--device {device}: no CUDA device is available")
    if Path(model).is_dir():
        cfg = from_hf_config(load_hf_state(model).config, name=Path(model).name)
        if num_layers is not None and num_layers != cfg.num_hidden_layers:
            if cfg.num_kv_shared_layers:
                raise PerfkitError("--num-layers cannot truncate a KV-shared (E2B/E4B) checkpoint")
            cfg = truncate_layers(cfg, num_layers)
        return build_model(cfg, device, dtypes[dtype], weights="hf", path=model)
    if model not in PRESET_NAMES:
        raise PerfkitError(
            f"--model {model!r}: neither a checkpoint directory nor a preset ({', '.join(PRESET_NAMES)})"
        )
    return build_model(get_preset(model, num_layers), device, dtypes[dtype], weights="random", seed=seed)
