"""Build a Gemma4ForCausalLM with random (seeded) or HF-checkpoint weights, directly on the target device.

Random: modules are built on the meta device, materialised with `to_empty` on the target device/dtype and
filled in place with a seeded generator on that device (no CPU init, no per-element Python): matrices
~ N(0, 0.02), every 1-D parameter (norm weights, router scales) and `layer_scalar` = 1.

HF: a directory with config.json + *.safetensors (sharded via model.safetensors.index.json or a glob), opened
memory-mapped with `safetensors.safe_open`. Text tensors are named `model.language_model.<name>` (multimodal
checkpoints) or `model.<name>` (Gemma4ForCausalLM); `<name>` is our state-dict name. Other tensors (vision
tower, audio tower, projectors) stay reachable through `load_hf_state(path)` for their own modules.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from perfkit.errors import PerfkitError
from perfkit.runtime.model import Gemma4ForCausalLM
from perfkit.runtime.model_config import Gemma4Config, from_hf_config

TEXT_PREFIXES = ("model.language_model.", "model.")
INIT_STD = 0.02


class HFState(Mapping[str, Tensor]):
    """Lazy, memory-mapped view of a safetensors checkpoint: `state[hf_name]` loads one tensor (CPU)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise PerfkitError(f"checkpoint directory {self.path} does not exist")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise PerfkitError(f"checkpoint directory {self.path} has no *.safetensors files")
        self._handles = {}
        for f in files:
            if not (self.path / f).exists():
                raise PerfkitError(f"checkpoint shard {self.path / f} (named in the index) does not exist")
            self._handles[f] = safe_open(str(self.path / f), framework="pt", device="cpu")
        if not weight_map:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self._where = weight_map

    @property
    def config(self) -> dict[str, Any]:
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise PerfkitError(f"checkpoint directory {self.path} has no config.json")
        return json.loads(cfg.read_text())

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._where:
            raise KeyError(key)
        return self._handles[self._where[key]].get_tensor(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[key]].get_slice(key).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def text_name(self, name: str) -> str | None:
        """HF key of our text-decoder tensor `name` (e.g. 'layers.0.self_attn.q_proj.weight'), or None."""
        for prefix in TEXT_PREFIXES:
            if prefix + name in self._where:
                return prefix + name
        return name if name in self._where else None

    def non_text_keys(self) -> list[str]:
        """Keys that are not under the text decoder (vision/audio towers, projectors): for other modules."""
        return [k for k in self._where if k.startswith(("model.vision_tower.", "model.embed_vision.", "model.audio"))]


def load_hf_state(path: str | Path) -> HFState:
    """Lazy dict-like access to every tensor of an HF safetensors checkpoint directory (memory-mapped)."""
    return HFState(path)


def open_weights(weights: str, path: str | Path | None) -> HFState | None:
    """The `weights` argument of the model builders (here and perfkit.runtime.tp), checked in one place:
    "random" -> None (the caller draws seeded weights), "hf" -> the checkpoint at `path` (lazily read)."""
    if weights == "hf":
        if path is None:
            raise PerfkitError('weights="hf" needs a checkpoint directory (path=...)')
        return load_hf_state(path)
    if weights != "random":
        raise PerfkitError(f"unknown weights {weights!r}; allowed: random, hf")
    return None


def build_model(
    cfg: Gemma4Config | None,
    device: torch.device | str,
    dtype: torch.dtype,
    weights: str = "random",
    path: str | Path | None = None,
    seed: int = 0,
) -> Gemma4ForCausalLM:
    """Gemma4ForCausalLM on `device` at `dtype`, in eval mode without grads. `cfg=None` with weights="hf" reads
    the checkpoint's config.json."""
    device = torch.device(device)
    state = open_weights(weights, path)
    if state is not None and cfg is None:
        cfg = from_hf_config(state.config, name=Path(path).name)
    if cfg is None:
        raise PerfkitError('build_model needs a config unless weights="hf"')
    model = Gemma4ForCausalLM(cfg, device="meta", dtype=dtype)
    model.to_empty(device=device)
    model.requires_grad_(False)
    with torch.no_grad():
        if state is None:
            init_random_(model, seed)
        else:
            load_hf_weights_(model, state)
    model.eval()
    model.setup_rope()
    return model


def init_random_(model: Gemma4ForCausalLM, seed: int = 0, std: float = INIT_STD) -> None:
    """Seeded in-place init on the model's own device: 1-D tensors (norms, scales, layer_scalar) = 1, the rest
    ~ N(0, std). Same seed + device type + dtype -> same weights."""
    gen = torch.Generator(device=model.device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for _, t in model.state_dict(keep_vars=True).items():
            if t.dim() <= 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, std, generator=gen)


def load_hf_weights_(model: Gemma4ForCausalLM, state: HFState) -> None:
    """Copy every text-decoder tensor from `state` into `model` (cast to its dtype, straight to its device)."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            key = state.text_name(name)
            if key is None:
                raise PerfkitError(
                    f"checkpoint {state.path}: missing tensor {TEXT_PREFIXES[0]}{name} (or model.{name}), "
                    f"expected shape {list(t.shape)}"
                )
            shape = state.shape(key)
            if shape != tuple(t.shape):
                raise PerfkitError(
                    f"checkpoint {state.path}: tensor {key} has shape {list(shape)}, expected {list(t.shape)}"
                )
            t.copy_(state[key])
