"""Gemma4 text decoder (shared/reference/gemma4.md §2-§3), flat varlen token layout, attention via a backend.

Module and parameter names follow HF's `Gemma4TextModel` so checkpoint keys map 1:1 once the
`model.language_model.` / `model.` prefix is stripped. Shapes: T tokens in the step, H hidden, nh query heads,
kvh KV heads, hd head dim of the layer (256 sliding / 512 full), L layers, P PLE width, E experts, K top-k.
All matmuls run in the weight dtype; norms, softmax and the final soft-cap run in fp32.

Fused path (`model.set_fused(True)`, default off): the norms, the GeGLU activations, q/k-norm + RoPE (+ v_norm) and
the MoE block run through the Triton kernels in perfkit/kernels/ (rmsnorm, gelu_mul, qk_norm_rope, moe), and each
decoder layer is, in launches:

    [qkv GEMM] -> [qkv_norm_rope: q-norm+RoPE, k-norm+RoPE, v_norm, K/V written straight into the paged cache]
    -> [attention] -> [o GEMM] -> [sandwich] -> [gate_up GEMM] -> [gelu_mul on the two halves] -> [down GEMM]
    -> [sandwich that also emits the NEXT layer's input_layernorm output]

- Merged projections: switching fused on concatenates each attention's q_proj | k_proj | v_proj weights (K=V full
  layers: q | k) into one [(nh + kvh [+ kvh]) * hd, H] tensor and each MLP's gate_proj | up_proj into one [2I, H]
  tensor, and re-points the nn.Linear `.weight` Parameters at row-slice VIEWS of it: no second copy, parameter
  names, state_dict keys, HF loading and `load_state_dict` (in-place copy_) unchanged, and the unfused path reads
  the same storage (the merged tensors are plain attributes, not registered). Every fused forward checks the
  views are still views (same modules, same Parameters, same data_ptr; host-only): a Linear swapped for another module (quant.py's Fp8Linear /
  Nvfp4Linear, TP shards made after merging) or weights replaced in place (`model.to(dtype)`) drop the merged
  tensor and fall back to separate GEMMs until the next `set_fused(True)` merges again. KV-shared layers (only
  q_proj) have nothing to merge.
- K/V straight into the cache: the attention backend's `kv_write_target(layer)` gives (cache, slot_page,
  slot_offset, k_scale, v_scale) of the current step; the kernel writes there (an fp8 cache quantised with the
  scales, as the backend's write would) and the layer calls `attend(layer, q, None, None)`. Backends without a
  paged cache get k, v through `attend` as before.
- Sandwiches: each post-norm + residual add also emits the pre-norms that read the new residual; the last one
  of a layer (the PLE one on E2B/E4B) also emits the next layer's input_layernorm, so `decode_layers` (the layer
  loop of `forward` and of the CUDA-graph body) passes (h, normed h) from layer to layer; the first layer still
  runs its own rmsnorm.
- One-row GEMMs (batch-1 decode): every product of a plain weight (merged rows, nn.Linear, the tied LM head) goes
  through `linear(x, lin, tiles)`, which takes perfkit's gemv (perfkit/kernels/gemv.py) when `set_decode_gemv` gave
  the weight's (N, K, dtype) a tile (toggle decode_gemv), else cuBLAS; more than one row is always cuBLAS.
- Fewer launches at batch 1 (`set_decode_fusion`, toggle decode_fusion), where both products are gemvs: the down
  gemv applies GeGLU to the [1, 2I] gate_up output as it loads it (no gelu_mul launch; only on the down shapes
  `set_decode_gemv` gave a GLU tile, which auto does where that form timed faster), and a MoE layer's router
  product rides in the dense gate_up's launch (`gemv_pair`). Bit-identical to the separate launches.
- A MoE layer's two feed-forward branches side by side (toggle decode_moe_ffn=branches): at decode steps of up to
  FFN_BRANCH_MAX_ROWS rows, the dense MLP runs on a second CUDA stream (`ffn_stream`, made by `set_decode_fusion`)
  while the routing and the experts run on the current one; the router's product rides in the attention
  sandwich's launch. Neither branch reads the other's output, so in a captured decode graph they become two
  branches whose kernels overlap: each small weight stream's ramp and tail (~2.4 us a launch on the H200) is hidden
  behind the other branch's streaming. Without a CUDA stream (CPU) the branches run one after the other.
- The q/k norm launch inside the decode kernel (toggle decode_prologue): a backend with `attend_raw` (FlashInfer's,
  on a Triton decode plan at a decode-only step) takes the raw q / k / v projections, and its decode kernel norms
  and ropes q and makes, writes and uses the newest K / V row itself (perfkit/kernels/paged_decode.py, "Prologue");
  where it cannot, it returns None and the layer launches qkv_norm_rope as above.

Module structure, nn.Linear attributes and parameter names are the same on both paths; triton is imported only
when the fused path is switched on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from perfkit.runtime.attention.base import AttentionBackend, AttnLayer
from perfkit.runtime.model_config import Gemma4Config

if TYPE_CHECKING:  # Triton is imported on first use only (_kernels)
    from perfkit.kernels.decode_io import GreedyIds


def _kernels(pdl: bool = False) -> SimpleNamespace:
    """The fused Triton ops, imported on first use (TRITON_INTERPRET must be set before this on CPU). pdl: every
    launcher bound to launch with programmatic dependent launch (perfkit/kernels/pdl.py; set_pdl). One shared
    namespace per value (tests patch its entries)."""
    return _kernel_table(bool(pdl))


@functools.cache
def _kernel_table(pdl: bool) -> SimpleNamespace:
    from perfkit.kernels import decode_io, gelu_mul, gemv, moe, moe_ffn, qk_norm_rope, rmsnorm

    def bind(fn):
        return functools.partial(fn, pdl=pdl)

    return SimpleNamespace(
        gemv=bind(gemv.gemv),
        rmsnorm=bind(rmsnorm.rmsnorm),
        sandwich=bind(rmsnorm.sandwich_rmsnorm),
        gelu_mul=bind(gelu_mul.gelu_mul),
        gelu_mul_cat=bind(gelu_mul.gelu_mul_cat),
        gemv_pair=bind(gemv.gemv_pair),
        gemv_routed=bind(gemv.gemv_routed),
        qk_norm_rope=bind(qk_norm_rope.qk_norm_rope),
        qkv_norm_rope_split=bind(qk_norm_rope.qkv_norm_rope_split),
        split_qkv=qk_norm_rope.split_qkv,  # views only, no launch
        moe_routing=bind(moe.moe_routing),
        fused_moe=bind(moe.fused_moe),
        moe_ffn=bind(moe_ffn.moe_ffn),
        moe_ffn_fits=moe_ffn.moe_ffn_fits,  # no launch
        decode_rows=bind(decode_io.decode_rows),
        softcap_argmax=bind(decode_io.softcap_argmax),
    )


@dataclass(frozen=True)
class MergedRows:
    """One [sum N_i, K] weight whose row slices are the `.weight` (views) of plain nn.Linear modules."""

    weight: Tensor
    parts: tuple[tuple[nn.Module, Tensor, int], ...]  # (linear, its weight Parameter, data_ptr of its view)

    def __call__(self, x: Tensor) -> Tensor:  # [T, K] -> [T, sum N_i]
        return F.linear(x, self.weight)

    def intact(self, linears: Sequence[nn.Module]) -> bool:
        """True while the same Linears hold the same Parameters still pointing at their rows of `weight`: a
        swapped module (quantisation, TP sharding) or replaced data (`model.to(dtype)`) breaks it. Host-only, and
        run by every fused forward outside CUDA graphs, hence the direct `_parameters` lookup (~1 us per layer)."""
        if len(linears) != len(self.parts):
            return False
        for m, (pm, pw, ptr) in zip(linears, self.parts, strict=True):
            if m is not pm or m._parameters.get("weight") is not pw or pw.data_ptr() != ptr:
                return False
        return True


MOE_FFN_FORMS = ("separate", "fused", "branches")  # a MoE layer's FFN block at decode (set_decode_fusion)
# The most rows a step may have for the FFN branches (decode_moe_ffn=branches): the decode graphs' batches up to
# 32; larger (prefill) steps take the separate launches. H200, 26B-A4B bf16 TPOT, separate -> branches: c1 -5.0 %,
# c4 -8.9 % (docs/h200-runs/2026-12-12), and with the limit raised from 8 (12-13 call 3, one run each) c8 -6.4 %,
# c16 -4.8 %, c32 -3.8 %; above it no gain (call 6: c48 -0.4 %, c64 -0.9 %, the decode forward's device time +-0.4 %).
FFN_BRANCH_MAX_ROWS = 32


class SideStream:
    """The CUDA stream a MoE layer's dense MLP runs on with decode_moe_ffn=branches. A copy of the model (deepcopy)
    shares it: a stream is a device queue, not state, and torch's streams cannot be copied."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def __deepcopy__(self, memo: dict) -> SideStream:
        return self

# (N, K, dtype) of a plain weight -> the gemv tile its one-row products take (set by set_decode_gemv); empty = cuBLAS.
# A plain dict, never changed in place (set_decode_gemv assigns a new one): a mappingproxy would stop deepcopy.
GemvTiles = Mapping[tuple[int, int, torch.dtype], object]
NO_GEMV: GemvTiles = {}


def _plain_weight(lin) -> Tensor | None:
    """The [N, K] weight of a bias-free nn.Linear or of merged rows; None for anything else (quantised, TP)."""
    if isinstance(lin, MergedRows) or (type(lin) is nn.Linear and lin.bias is None):
        return lin.weight
    return None


def _gemv_tile(x: Tensor, w: Tensor | None, tiles: GemvTiles):
    """The gemv tile for x @ w^T when x is one row (batch-1 decode) and w's shape has one in `tiles`; else None."""
    if not tiles or w is None or x.shape[0] != 1 or x.dtype != w.dtype or x.stride(1) != 1:
        return None
    return tiles.get((w.shape[0], w.shape[1], w.dtype))


def linear(x: Tensor, lin, tiles: GemvTiles, pdl: bool = False) -> Tensor:
    """lin(x) on the fused path, through the Triton gemv (perfkit/kernels/gemv.py) instead of cuBLAS when
    `_gemv_tile` has a tile for it (launched with PDL when pdl)."""
    w = _plain_weight(lin) if tiles else None
    tile = _gemv_tile(x, w, tiles)
    return lin(x) if tile is None else _kernels(pdl).gemv(x, w, tile)


def merge_linear_rows(linears: Sequence[nn.Module]) -> MergedRows | None:
    """Concatenate the weights of plain bias-free nn.Linear modules (one dtype, device and in_features) into one
    [sum N_i, K] tensor and re-point each `.weight` Parameter at its row slice (a view of the merged tensor), so
    one GEMM computes all outputs and the weights exist once. Returns None (nothing changed) for anything else:
    quantised Linears, subclasses, biases, mixed dtypes, meta tensors."""
    if not linears or not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return None
    ws = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or ws[0].device.type == "meta":
        return None
    with torch.no_grad():
        merged = torch.cat([w.detach() for w in ws], dim=0)  # [sum N_i, K]
        row = 0
        for w in ws:
            n = w.shape[0]
            w.data = merged[row : row + n]  # same Parameter object: names, hooks, requires_grad kept
            row += n
    return MergedRows(merged, tuple((m, w, w.data_ptr()) for m, w in zip(linears, ws, strict=True)))


def merge_projections(linears: Sequence[nn.Module]):
    """`merge_linear_rows` for nn.Linear; quantised linears that know how to merge themselves (a `merge_rows`
    classmethod: runtime/quant.py's Fp8Linear / Nvfp4Linear) do it their way. The result is called on the input
    (one GEMM) and has `.weight` and `.intact(linears)`; None when nothing merged."""
    merged = merge_linear_rows(linears)
    if merged is None and linears and len({type(m) for m in linears}) == 1:
        merge = getattr(type(linears[0]), "merge_rows", None)
        merged = merge(list(linears)) if merge is not None else None
    return merged


def _kv_write_target(
    attn: AttentionBackend, layer: AttnLayer, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, float, float] | None:
    """The backend's direct-write target for this layer's K/V when the kernel can write it (a cache of the
    activation dtype, or fp8 with its scales), else None. Backends without the method (test doubles wrapping one)
    get k, v through attend."""
    get = getattr(attn, "kv_write_target", None)
    target = None if get is None else get(layer)
    if target is not None and target[0].dtype not in (dtype, torch.float8_e4m3fn):
        return None
    return target


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Plain `x * w` RMSNorm (NOT Gemma-2/3's `1 + w`), computed in fp32, cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


class RMSNorm(nn.Module):
    fused = False  # set by Gemma4ForCausalLM.set_fused
    pdl = False  # set by Gemma4ForCausalLM.set_pdl

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return _kernels(self.pdl).rmsnorm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def round_to(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype` (HF casts its embedding-scale tensors to the weight dtype), as a Python float."""
    return torch.tensor(x, dtype=torch.float32).to(dtype).item()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE. x [T, heads, hd]; cos/sin [T, hd/2] (one entry per frequency; dim d pairs with d+hd/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_inv_freq(cfg: Gemma4Config, sliding: bool) -> Tensor:
    """[hd/2] fp32 inverse frequencies. Sliding: default rope over 256 dims, theta 1e4. Full: "proportional":
    64 live frequencies theta^(-2i/512) (denominator = the full head dim), the other 192 are zero (pass through)."""
    if sliding:
        hd, theta = cfg.head_dim, cfg.rope_theta
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    hd, theta = cfg.global_head_dim, cfg.global_rope_theta
    live = int(cfg.global_partial_rotary_factor * hd // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * live, 2, dtype=torch.float) / hd))
    return torch.cat([inv, torch.zeros(hd // 2 - live)])


class RopeTables:
    """cos/sin [max_positions, hd/2] per layer type, computed once in fp32 and stored in the compute dtype."""

    def __init__(self, cfg: Gemma4Config, max_positions: int, device: torch.device, dtype: torch.dtype):
        self.max_positions = max_positions
        pos = torch.arange(max_positions, device=device, dtype=torch.float)
        self.tables: dict[bool, tuple[Tensor, Tensor]] = {}
        for sliding in (True, False):
            freqs = pos[:, None] * rope_inv_freq(cfg, sliding).to(device)[None, :]  # [P, hd/2] fp32
            self.tables[sliding] = (freqs.cos().to(dtype), freqs.sin().to(dtype))

    def lookup(self, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
        return {s: (c[positions], sn[positions]) for s, (c, sn) in self.tables.items()}


class Gemma4MLP(nn.Module):
    fused = False
    gemv_tiles: GemvTiles = NO_GEMV  # set by Gemma4ForCausalLM.set_decode_gemv
    pdl = False  # set by Gemma4ForCausalLM.set_pdl
    decode_fusion = False  # set by Gemma4ForCausalLM.set_decode_fusion
    glu_tiles: GemvTiles = NO_GEMV  # set by set_decode_gemv: the down shapes whose GLU gemv form decode_fusion takes

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)  # [I, H]
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)  # [I, H]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)  # [H, I]
        self.gate_up: MergedRows | None = None  # fused path: [2I, H] (gate rows, then up), a plain attribute

    def _linears(self) -> list[nn.Module]:
        mods = self._modules  # direct lookups: called by every fused forward
        return [mods["gate_proj"], mods["up_proj"]]

    def merge_projections(self) -> bool:
        """Fused path: gate_proj | up_proj as views of one [2I, H] tensor (see the module docstring)."""
        if self.gate_up is None or not self.gate_up.intact(self._linears()):
            self.gate_up = merge_projections(self._linears())
        return self.gate_up is not None

    def merged_weight(self) -> Tensor | None:
        """The merged [2I, H] weight while the Linears still view it; otherwise drop it (frees it) -> None."""
        if self.gate_up is not None and not self.gate_up.intact(self._linears()):
            self.gate_up = None
        return None if self.gate_up is None else self.gate_up.weight

    def decode_linears(self) -> list:
        """The linears (or merged rows) the fused forward multiplies by."""
        if self.merged_weight() is not None:
            return [self.gate_up, self.down_proj]
        return [*self._linears(), self.down_proj]

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        if self.fused:
            return self.forward_fused(x)[0]
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(
        self, x: Tensor, side: tuple[Tensor, nn.Module] | None = None, route: tuple[int, Tensor] | None = None
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor] | None]:
        """The MLP on the fused path -> (mlp(x) [T, H], side[1](side[0]) or None). side: (x2 [T, H], a linear of
        the same in_features): a product of another input that rides in the gate_up launch when both are
        one-row gemvs (the 26B-A4B router; see `_paired`), else runs as its own `linear`. route: (top_k,
        per_expert_scale) when side is a MoE router: where the down product is a gemv (GLU or plain), one more
        program of its launch routes the router's logits (`gemv_routed`) and the side result is (weights fp32
        [T, k], ids int32 [T, k]).

        decode_fusion: the down product takes the gate_up output itself (gemv glu=True: GeGLU on load, no
        gelu_mul launch) when it is one row and `glu_tiles` has a tile for its shape (decode_gemv=auto: where that
        form timed faster than the two launches). Both forms are bit-identical to the separate launches."""
        K, w, t, p = _kernels(self.pdl), self.merged_weight(), self.gemv_tiles, self.pdl
        if w is None:  # unmerged (quantised, TP): separate products
            g, u = linear(x, self.gate_proj, t, p), linear(x, self.up_proj, t, p)
            s = None if side is None else linear(side[0], side[1], t, p)
            return linear(K.gelu_mul(g, u), self.down_proj, t, p), s
        paired = self._paired(x, w, side)
        if paired is not None:
            gu, s = K.gemv_pair(x, w, side[0], paired[0], paired[1])
        else:  # one GEMM -> [T, 2I]
            gu = linear(x, self.gate_up, t, p)
            s = None if side is None else linear(side[0], side[1], t, p)
        w_down = _plain_weight(self.down_proj) if self.decode_fusion else None
        glu = _gemv_tile(gu, w_down, self.glu_tiles)  # GeGLU inside the down gemv
        h = gu if glu is not None else K.gelu_mul_cat(gu)  # gelu_mul reads the two strided halves
        tile = glu if glu is not None else _gemv_tile(h, w_down, t)
        if tile is not None and route is not None and s is not None:  # the routing rides in the down gemv's launch
            y, rw, ridx = K.gemv_routed(h, w_down, s, *route, tile, glu=glu is not None)
            return y, (rw, ridx)
        if glu is not None:
            return K.gemv(gu, w_down, glu, glu=True), s
        return linear(h, self.down_proj, t, p), s

    def _paired(self, x: Tensor, w: Tensor, side: tuple[Tensor, nn.Module] | None) -> tuple[Tensor, object] | None:
        """(side weight, gate_up's gemv tile) when decode_fusion is on and gate_up and the side product are both
        one-row gemvs of the same K and dtype (`gemv_pair` launches them together on gate_up's tile); else None."""
        if not self.decode_fusion or side is None:
            return None
        w2 = _plain_weight(side[1])
        tile = _gemv_tile(x, w, self.gemv_tiles)
        if tile is None or w2 is None or w2.shape[1] != w.shape[1] or _gemv_tile(side[0], w2, self.gemv_tiles) is None:
            return None
        return w2, tile


class Gemma4Attention(nn.Module):
    fused = False
    gemv_tiles: GemvTiles = NO_GEMV  # set by Gemma4ForCausalLM.set_decode_gemv
    pdl = False  # set by Gemma4ForCausalLM.set_pdl

    def __init__(self, cfg: Gemma4Config, layer: AttnLayer):
        super().__init__()
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        H, nh, kvh, hd = cfg.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.q_proj = nn.Linear(H, nh * hd, bias=False)  # [nh*hd, H]
        self.o_proj = nn.Linear(nh * hd, H, bias=False)  # [H, nh*hd]
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if layer.writes_kv:
            self.k_proj = nn.Linear(H, kvh * hd, bias=False)  # [kvh*hd, H]
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
            # K=V full layers: V is v_norm(raw k_proj output), so there is no v_proj
            self.v_proj = None if cfg.layer_k_eq_v(layer.index) else nn.Linear(H, kvh * hd, bias=False)
        self.qkv: MergedRows | None = None  # fused path: [(nh + kvh [+ kvh]) * hd, H], a plain attribute

    def _linears(self) -> list[nn.Module]:
        """The projections that merge: q | k (| v); none on KV-shared layers (direct lookups: every fused forward)."""
        if not self.layer.writes_kv:
            return []
        mods = self._modules  # v_proj: a registered module, or the plain attribute None (K=V layers)
        v = mods.get("v_proj")
        return [mods["q_proj"], mods["k_proj"]] + ([] if v is None else [v])

    def merge_projections(self) -> bool:
        """Fused path: q_proj | k_proj (| v_proj) as views of one tensor (see the module docstring). KV-shared
        layers have only q_proj: nothing to merge."""
        linears = self._linears()
        if linears and (self.qkv is None or not self.qkv.intact(linears)):
            self.qkv = merge_projections(linears)
        return self.qkv is not None

    def merged_weight(self) -> Tensor | None:
        """The merged qkv weight while the Linears still view it; otherwise drop it (frees it) -> None."""
        if self.qkv is not None and not self.qkv.intact(self._linears()):
            self.qkv = None
        return None if self.qkv is None else self.qkv.weight

    def decode_linears(self) -> list:
        """The linears (or merged rows) the fused forward multiplies by."""
        if not self.layer.writes_kv:
            return [self.q_proj, self.o_proj]
        if self.merged_weight() is not None:
            return [self.qkv, self.o_proj]
        return [*self._linears(), self.o_proj]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        if self.fused:
            return self.forward_fused(x, cos, sin, attn)
        T, hd = x.shape[0], self.layer.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, -1, hd)), cos, sin)  # [T, nh, hd]
        k = v = None
        if self.layer.writes_kv:
            k_raw = self.k_proj(x).view(T, -1, hd)  # [T, kvh, hd]
            v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(T, -1, hd)
            k = apply_rope(self.k_norm(k_raw), cos, sin)
            v = rms_norm(v_raw, None, self.eps)  # v_norm: no weight, no rope
        o = attn.attend(self.layer, q, k, v)  # [T, nh, hd]
        return self.o_proj(o.reshape(T, -1))

    def forward_fused(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        """One qkv GEMM (merged weight; separate GEMMs when not merged) and one qkv_norm_rope launch for q, k, v,
        K/V written straight into the backend's cache when it offers a target. KV-shared layers: q only."""
        K, T, la, t, p = _kernels(self.pdl), x.shape[0], self.layer, self.gemv_tiles, self.pdl
        hd = la.head_dim
        fold = getattr(attn, "attend_raw", None)  # the decode kernel's own q/k norm + RoPE (toggle decode_prologue)
        if not la.writes_kv:
            q_raw = linear(x, self.q_proj, t, p).view(T, -1, hd)
            o = None if fold is None else fold(la, q_raw, None, None, self.q_norm.weight, None, cos, sin, self.eps)
            if o is None:
                o = attn.attend(la, K.qk_norm_rope(q_raw, self.q_norm.weight, cos, sin, self.eps), None, None)
            return linear(o.reshape(T, -1), self.o_proj, t, p)
        w = self.merged_weight()
        if w is not None:  # [T, (nh + kvh [+ kvh]) * hd] -> views, no copies
            qkv = linear(x, self.qkv, t, p)
            q_raw, k_raw, v_raw = K.split_qkv(qkv, la.num_heads, la.num_kv_heads, hd, self.v_proj is None)
        else:  # unmergeable projections (fp4-native, TP-sharded, mixed types)
            q_raw, k_raw = linear(x, self.q_proj, t, p).view(T, -1, hd), linear(x, self.k_proj, t, p).view(T, -1, hd)
            v_raw = None if self.v_proj is None else linear(x, self.v_proj, t, p).view(T, -1, hd)
        qw, kw = self.q_norm.weight, self.k_norm.weight
        o = None if fold is None else fold(la, q_raw, k_raw, v_raw, qw, kw, cos, sin, self.eps)
        if o is None:  # the separate launch: q, and K / V into the cache (or to attend when it offers no target)
            target = _kv_write_target(attn, la, q_raw.dtype)
            q, k, v = K.qkv_norm_rope_split(q_raw, k_raw, v_raw, qw, kw, cos, sin, self.eps, target)
            o = attn.attend(la, q, k, v)  # q [T, nh, hd]; k, v [T, kvh, hd] or None when written into the cache
        return linear(o.reshape(T, -1), self.o_proj, t, p)


class Gemma4Router(nn.Module):
    """softmax(fp32) over experts -> top-k -> renormalise -> * per_expert_scale (HF order)."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.scalar_root_size = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # [E, H]
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))  # [H]
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))  # [E]

    def forward(self, r: Tensor) -> tuple[Tensor, Tensor]:  # r [T, H] un-normed residual
        z = rms_norm(r, None, self.eps) * self.scale * self.scalar_root_size
        probs = torch.softmax(self.proj(z), dim=-1, dtype=torch.float32)  # [T, E]
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx  # fp32 weights [T, K], long idx [T, K]


class Gemma4Experts(nn.Module):
    """E GeGLU experts as stacked 3-D weights (HF layout). No Python loop over all E experts."""

    gather_max_rows = 64  # T*K at or below this: gather the chosen experts' weights (no host sync; decode)
    fused = False
    pdl = False  # set by Gemma4ForCausalLM.set_pdl

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        E, H, Im = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.intermediate = Im
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Im, H))  # rows [0, Im) gate, [Im, 2Im) up
        self.down_proj = nn.Parameter(torch.empty(E, H, Im))

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """x [T, H], idx / w [T, K] -> [T, H]."""
        if self.fused:  # grouped Triton GEMMs, any T, no host sync
            return _kernels(self.pdl).fused_moe(x, self.gate_up_proj, self.down_proj, w, idx)
        if idx.numel() <= self.gather_max_rows:
            return self.forward_gather(x, idx, w)
        return self.forward_sorted(x, idx, w)

    def _expert(self, x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        gate, up = (x @ gate_up.transpose(-1, -2)).split(self.intermediate, dim=-1)
        return (gelu_tanh(gate) * up) @ down.transpose(-1, -2)

    def forward_gather(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)  # [T*K]
        xs = x.repeat_interleave(K, dim=0)[:, None, :]  # [T*K, 1, H]
        y = self._expert(xs, self.gate_up_proj[flat], self.down_proj[flat])[:, 0]  # [T*K, H]
        y = (y * w.reshape(-1, 1)).to(x.dtype)
        return y.view(T, K, -1).sum(dim=1)

    def forward_sorted(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)  # [T*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # one host sync
        token = order // K  # token of each sorted (token, slot) pair
        xs = x[token]  # [T*K, H] grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._expert(xs[start : start + n], self.gate_up_proj[e], self.down_proj[e])
                start += n
        ys = (ys * w.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(x)
        return out.index_add_(0, token, ys)


class Gemma4DecoderLayer(nn.Module):
    fused = False
    gemv_tiles: GemvTiles = NO_GEMV  # set by Gemma4ForCausalLM.set_decode_gemv
    pdl = False  # set by Gemma4ForCausalLM.set_pdl
    decode_fusion = False  # set by Gemma4ForCausalLM.set_decode_fusion
    decode_routing = False  # set by Gemma4ForCausalLM.set_decode_fusion (MoE layers: the routing in the down launch)
    decode_moe_ffn = "separate"  # set by Gemma4ForCausalLM.set_decode_fusion (MoE layers: separate | fused |
    # branches, the FFN block's form at decode)
    ffn_stream: SideStream | None = None  # set by set_decode_fusion with branches on CUDA (the dense MLP's stream)

    def __init__(self, cfg: Gemma4Config, layer: AttnLayer):
        super().__init__()
        H, eps, i = cfg.hidden_size, cfg.rms_norm_eps, layer.index
        self.is_sliding = layer.is_sliding
        self.self_attn = Gemma4Attention(cfg, layer)
        self.mlp = Gemma4MLP(H, cfg.layer_intermediate_size(i))
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # [1], checkpoint "skip_scale"
        self.enable_moe_block = cfg.enable_moe_block
        if cfg.enable_moe_block:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.has_ple = cfg.has_ple
        if cfg.has_ple:
            P = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)  # [P, H]
            self.per_layer_projection = nn.Linear(P, H, bias=False)  # [H, P]
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionBackend, ple: Tensor | None
    ) -> Tensor:  # h [T, H]; ple [T, P] or None
        if self.fused:
            return self.forward_fused(h, rope, attn, ple)[0]
        r = h
        h = r + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), *rope, attn))
        r = h
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.enable_moe_block:  # parallel dense MLP + MoE; router and experts read the residual r
            w, idx = self.router(r)
            e = self.experts(self.pre_feedforward_layernorm_2(r), idx, w)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h = r + self.post_feedforward_layernorm(m)
        if self.has_ple:
            g = gelu_tanh(self.per_layer_input_gate(h)) * ple  # [T, P]
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar  # scales the whole residual stream

    def forward_fused(
        self,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        attn: AttentionBackend,
        ple: Tensor | None,
        x: Tensor | None = None,
        next_norm: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Same math as `forward`; each post-norm + residual add also emits the pre-norms of the new residual
        (pre_feedforward_layernorm; MoE: pre_feedforward_layernorm_2 and the router's scaled norm), the MoE
        layer's two post-FFN norms are folded into the post_feedforward sandwich, layer_scalar into the last one.

        x: input_layernorm(h) [T, H] when the previous layer's last sandwich already computed it (None: run the
        rmsnorm here). next_norm: the next layer's input_layernorm weight [H], folded into this layer's last
        sandwich. Returns (h [T, H], next_norm(h) [T, H] or None)."""
        K, eps, t, p = _kernels(self.pdl), self.input_layernorm.eps, self.gemv_tiles, self.pdl
        if x is None:
            x = K.rmsnorm(h, self.input_layernorm.weight, eps)
        a = self.self_attn(x, *rope, attn)
        nxt, mults = [self.pre_feedforward_layernorm.weight], [1.0]
        ffn = self._moe_ffn_weights(a, K) if self.decode_moe_ffn == "fused" else None
        w_r = ffn[0] if ffn is not None else self._branch_router(a)
        if w_r is not None:  # the router's product rides in the sandwich's launch (its logits: ys[2])
            nxt += [self.pre_feedforward_layernorm_2.weight]
            mults += [1.0]
        elif self.enable_moe_block:
            nxt += [self.pre_feedforward_layernorm_2.weight, self.router.scale]
            mults += [1.0, self.router.scalar_root_size]
        router = None if w_r is None else (w_r, self.router.scale, self.router.scalar_root_size)
        r, ys = K.sandwich(
            a, h, self.post_attention_layernorm.weight, eps, next_weights=nxt, next_mults=mults, router=router
        )  # fmt: skip
        x2 = None
        if ffn is not None:  # the dense MLP and the experts in two launches
            m, e = K.moe_ffn(ys[0], ys[1], ys[2], *ffn[1:], self.router.top_k, self.router.per_expert_scale)
            x2 = (e, self.post_feedforward_layernorm_1.weight, self.post_feedforward_layernorm_2.weight)
        elif w_r is not None:  # the dense MLP and the experts on two branches
            m, e = self._ffn_branches(ys, K)
            x2 = (e, self.post_feedforward_layernorm_1.weight, self.post_feedforward_layernorm_2.weight)
        elif self.enable_moe_block:  # the router product rides in the dense gate_up's launch where it can
            rt = self.router
            route = (rt.top_k, rt.per_expert_scale) if self.decode_routing else None
            m, s = self.mlp.forward_fused(ys[0], side=(ys[2], rt.proj), route=route)
            w, idx = s if isinstance(s, tuple) else K.moe_routing(s, rt.top_k, rt.per_expert_scale)  # tuple: routed
            e = self.experts(ys[1], idx, w)  # in the down launch
            x2 = (e, self.post_feedforward_layernorm_1.weight, self.post_feedforward_layernorm_2.weight)
        else:
            m = self.mlp(ys[0])
        last_next = [] if next_norm is None else [next_norm]  # emitted by the layer's last sandwich
        if self.has_ple:
            h, _ = K.sandwich(m, r, self.post_feedforward_layernorm.weight, eps, x2=x2)
            g = K.gelu_mul(linear(h, self.per_layer_input_gate, t, p), ple)  # [T, P]
            h, ys = K.sandwich(
                linear(g, self.per_layer_projection, t, p), h, self.post_per_layer_input_norm.weight, eps,
                scalar=self.layer_scalar, next_weights=last_next,
            )  # fmt: skip
        else:
            h, ys = K.sandwich(
                m, r, self.post_feedforward_layernorm.weight, eps, x2=x2, scalar=self.layer_scalar,
                next_weights=last_next,
            )  # fmt: skip
        return h, (ys[0] if ys else None)

    def _branch_router(self, a: Tensor) -> Tensor | None:
        """The router's plain [E, H] weight when this MoE layer's FFN block runs on two branches at this step
        (decode_moe_ffn=branches, at most FFN_BRANCH_MAX_ROWS rows, a plain router weight in a's dtype, which the
        sandwich's router programs read); else None."""
        if self.decode_moe_ffn != "branches" or not self.enable_moe_block or a.shape[0] > FFN_BRANCH_MAX_ROWS:
            return None
        return self._sandwich_router(a)

    def _sandwich_router(self, a: Tensor) -> Tensor | None:
        """The router's [E, H] weight if the attention sandwich's router programs can read it (a plain, contiguous
        weight in a's dtype: the fused FFN block's and the branches' condition); else None."""
        w_r = _plain_weight(self.router.proj)
        return w_r if w_r is not None and w_r.is_contiguous() and w_r.dtype == a.dtype else None

    def _ffn_branches(self, ys: list[Tensor], K: SimpleNamespace) -> tuple[Tensor, Tensor]:
        """(dense MLP output, experts' output) of ys = [pre_ff(r), pre_ff_2(r), router logits], the dense MLP on
        ``ffn_stream`` (forked from the current stream, joined before returning) while the routing and the experts
        run on the current stream. The tensors each branch makes are freed only after the join is enqueued, and the
        next use of their memory is enqueued after it, so the caching allocator needs no record_stream. Without
        ``ffn_stream`` (CPU) the same launches run one after the other."""
        side = None if self.ffn_stream is None else self.ffn_stream.stream
        here = torch.cuda.current_stream() if side is not None else None
        if side is not None:
            side.wait_stream(here)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            m, _ = self.mlp.forward_fused(ys[0])
        w, idx = K.moe_routing(ys[2], self.router.top_k, self.router.per_expert_scale)
        e = self.experts(ys[1], idx, w)
        if side is not None:
            here.wait_stream(side)
        return m, e

    def _moe_ffn_weights(self, a: Tensor, K: SimpleNamespace) -> tuple[Tensor, ...] | None:
        """(router proj [E, H], dense gate_up [2I, H], dense down [H, I], experts' gate_up, experts' down) when this
        MoE layer's FFN block can run as `moe_ffn`'s two launches: one row, plain bf16 (or fp32) weights, the dense
        gate_up merged, bf16 experts (not quantised, not expert-parallel); else None (the separate launches)."""
        if not self.enable_moe_block or a.shape[0] != 1 or type(self.experts) is not Gemma4Experts:
            return None
        w_gu, w_down, w_r = self.mlp.merged_weight(), _plain_weight(self.mlp.down_proj), self._sandwich_router(a)
        ex = self.experts
        if w_gu is None or w_down is None or w_r is None:
            return None
        if not K.moe_ffn_fits(a, w_gu, w_down, ex.gate_up_proj, ex.down_proj, self.router.top_k):
            return None
        return w_r, w_gu, w_down, ex.gate_up_proj, ex.down_proj

    def decode_linears(self) -> list:
        """The linears (or merged rows) the fused forward multiplies by."""
        out = self.self_attn.decode_linears() + self.mlp.decode_linears()
        if self.enable_moe_block:
            out.append(self.router.proj)
        if self.has_ple:
            out += [self.per_layer_input_gate, self.per_layer_projection]
        return out


class Gemma4ForCausalLM(nn.Module):
    """Gemma4 text decoder with tied LM head. `forward` takes a flat [T] token layout (no batch dim)."""

    gemv_tiles: GemvTiles = NO_GEMV  # set by set_decode_gemv (the LM head's)
    pdl = False  # set by set_pdl
    own_lookups = True  # the table lookups and LM head are this class's (tensor parallelism shards them: tp.py)

    def __init__(self, cfg: Gemma4Config, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.attn_layers = cfg.attn_layers()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            H, L = cfg.hidden_size, cfg.num_hidden_layers
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # [V, H], tied to the LM head
            self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, layer) for layer in self.attn_layers)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            if cfg.has_ple:
                P = cfg.hidden_size_per_layer_input
                self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, L * P)  # [Vp, L*P]
                self.per_layer_model_projection = nn.Linear(H, L * P, bias=False)  # [L*P, H]
                self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps)
        if dtype is not None:
            self.to(dtype)
        self.rope: RopeTables | None = None
        self.fused = False
        self._gemv_timed: dict[tuple[int, int, torch.dtype, bool, bool], dict] = {}  # decode_gemv=auto's timings,
        # per shape, PDL setting and whether the shape's GLU form was timed too

    def set_moe_gather(self, kind: str) -> bool:
        """NVFP4 experts at decode sizes: "gemv" (the gathered W4A16 gemv, GeGLU and combine in torch) or
        "kernels" (two fused Triton kernels). Sets ``gather_kernels`` on every module that has one (the quantised
        experts, ``perfkit.runtime.quant.QuantizedExperts``; this module does not import them, which would import
        Triton). Returns whether any module has it: only then do captured graphs replay a different path."""
        if kind not in ("gemv", "kernels"):
            raise ValueError(f"moe_gather {kind!r}: allowed values are gemv, kernels")
        return self._set_module_flag("gather_kernels", kind == "kernels")

    def set_moe_prefill(self, kind: str) -> bool:
        """Quantised experts at prefill sizes: "quantized" (the grouped GEMMs dequantising in registers),
        "dequant" (the experts dequantised into a scratch, then the bf16 grouped GEMMs) or "auto" (each format's
        measured choice, ``QuantizedExperts.prefill_dequant`` None). Sets ``prefill_dequant`` on every module that
        has one; returns whether any has."""
        if kind not in ("auto", "quantized", "dequant"):
            raise ValueError(f"moe_prefill {kind!r}: allowed values are auto, quantized, dequant")
        return self._set_module_flag("prefill_dequant", None if kind == "auto" else kind == "dequant")

    def set_pdl(self, on: bool) -> None:
        """Launch the fused path's Triton kernels with programmatic dependent launch (perfkit/kernels/pdl.py): each
        may start while the kernel before it drains. Needs sm_90+ (the engine checks; toggle ``pdl``). Call before
        ``set_decode_gemv``: its timings depend on it."""
        self._set_module_flag("pdl", bool(on))

    def set_decode_fusion(self, on: bool, routed: bool = False, moe_ffn: str = "separate") -> None:
        """Fewer launches per batch-1 decode layer on the fused path (toggle ``decode_fusion``), each bit-identical to
        the launches it replaces: the down gemv applies GeGLU to the gate_up output as it loads it (no gelu_mul
        launch), and the 26B-A4B router's product shares the dense gate_up's gemv launch (no router launch).
        routed (toggle ``decode_routing``, with on): the MoE routing rides in the dense down product's GLU gemv
        launch as one more program (``gemv_routed``: no routing launch; the weights to fp32 rounding on the GPU).
        moe_ffn (toggle ``decode_moe_ffn``, with on): a MoE layer's feed-forward block at decode, "separate", "fused"
        (two launches after the sandwich, which computes the router's product: perfkit/kernels/moe_ffn.py) or
        "branches" (the dense MLP on a second CUDA stream beside the routing and the experts, the router's product
        in the sandwich: `Gemma4DecoderLayer._ffn_branches`); both rounding-level against separate."""
        if moe_ffn not in MOE_FFN_FORMS:
            raise ValueError(f"moe_ffn {moe_ffn!r}: allowed values are {', '.join(MOE_FFN_FORMS)}")
        form = moe_ffn if on else "separate"
        self._set_module_flag("decode_fusion", bool(on))
        self._set_module_flag("decode_routing", bool(on and routed))
        self._set_module_flag("decode_moe_ffn", form)
        device = self.embed_tokens.weight.device
        stream = SideStream(device) if form == "branches" and device.type == "cuda" else None
        self._set_module_flag("ffn_stream", stream)  # one stream, shared by every MoE layer

    def _set_module_flag(self, name: str, value: object) -> bool:
        """``name = value`` on every submodule whose class declares ``name``; whether any does."""
        found = False
        for m in self.modules():
            if hasattr(type(m), name):
                setattr(m, name, value)
                found = True
        return found

    def decode_weights(self) -> dict[tuple[int, int, torch.dtype], list[Tensor]]:
        """The plain [N, K] weights the fused forward multiplies by (merged rows where merged, the tied LM head),
        grouped by (N, K, dtype), each group in layer order. Quantised and TP-wrapped linears are left out."""
        groups: dict[tuple[int, int, torch.dtype], list[Tensor]] = {}
        lins = [lin for layer in self.layers for lin in layer.decode_linears()]
        for w in [_plain_weight(lin) for lin in lins] + [self.embed_tokens.weight]:
            if w is not None and w.dim() == 2 and w.device.type != "meta":
                groups.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
        return groups

    def set_decode_gemv(self, mode: str) -> dict:
        """Route the fused path's one-row products (batch-1 decode) through the Triton gemv, per weight shape:
        "cublas" none; "triton" every plain weight with ``gemv.default_tile``; "auto" the shapes where a gemv
        tile beat cuBLAS on this GPU, timed once per shape on the model's own weights (``gemv.time_gemv_choice``).
        Nothing routes (and nothing is timed) while the fused path is off, nor with auto off CUDA. Call after
        ``set_fused`` and ``set_pdl``: the merged qkv / gate_up shapes are the ones timed, and with PDL on the gemv
        tiles are timed launching with it.

        The dense MLPs' down shapes also get the tile of decode_fusion's GLU form (``glu_tiles``): "triton" the
        default tile, "auto" the fastest GLU tile where one beat [gelu_mul -> the shape's winner] (its row's
        "glu"), else none, and decode_fusion leaves that shape's two launches as they are.
        Returns {"mode", "shapes": {"NxK": the timing row or the tile}} for the result file."""
        if mode not in ("auto", "cublas", "triton"):
            raise ValueError(f"decode_gemv {mode!r}: allowed values are auto, cublas, triton")
        tiles: dict = {}
        glu_tiles: dict = {}
        shapes: dict[str, object] = {}
        if self.fused and (mode == "triton" or (mode == "auto" and self.device.type == "cuda")):
            from perfkit.kernels import gemv

            down = self._down_keys()
            for key, ws in self.decode_weights().items():
                N, K, _ = key
                if mode == "triton":
                    tiles[key] = gemv.default_tile(N, K)
                    if key in down:
                        glu_tiles[key] = tiles[key]
                    shapes[f"{N}x{K}"] = tiles[key].label
                    continue
                timed = (*key, self.pdl, key in down)
                if timed not in self._gemv_timed:
                    self._gemv_timed[timed] = gemv.time_gemv_choice(
                        ws[: gemv.TIMING_CALLS], pdl=self.pdl, glu=key in down
                    )
                row = self._gemv_timed[timed]
                for chosen, label in ((tiles, row["best"]), (glu_tiles, row.get("glu", {}).get("best", "separate"))):
                    tile = gemv.tile_by_label(label)
                    if tile is not None:
                        chosen[key] = tile
                shapes[f"{N}x{K}"] = row
        self._set_module_flag("gemv_tiles", tiles)
        self._set_module_flag("glu_tiles", glu_tiles)
        return {"mode": mode, "shapes": shapes}

    def set_w4a16_words(self, mode: str) -> dict[str, str]:
        """The NVFP4 weights' word order (toggle ``w4a16_words``): "standard" the checkpoint's; "repacked" every
        W4A16 weight's in ``repack_words``' order (the tensor-core gemv decodes it with fewer instructions; every
        path gives the same result bit for bit); "auto" the weights whose batch-1 product is faster so
        (``Nvfp4Linear.repack_pays``: one wave of tensor-core gemv programs). Each weight is rewritten in place;
        the modules whose weights are views of a merged q|k|v / gate|up weight follow its order, which the merged
        shape decides (call after ``set_fused``). Modules without ``set_words`` (other formats) are left alone.
        Returns {"NxK": "repacked" | "standard"} per weight shape of the fused path's NVFP4 weights."""
        if mode not in ("auto", "standard", "repacked"):
            raise ValueError(f"w4a16_words {mode!r}: allowed values are auto, standard, repacked")
        decode = [getattr(lin, "module", lin) for layer in self.layers for lin in layer.decode_linears()]
        decode = [m for m in decode if hasattr(m, "set_words")]  # merged q|k|v / gate|up first: they decide
        held = [m for m in [*decode, *self.modules()] if hasattr(m, "set_words") and m.weight.device.type != "meta"]
        owners: dict[int, nn.Module] = {}  # weight storage -> the module that decides its order
        for m in held:
            owners.setdefault(m.weight.untyped_storage().data_ptr(), m)
        changed = False
        for m in owners.values():
            changed |= m.set_words(mode == "repacked" or (mode == "auto" and m.repack_pays()))
        for m in held:
            m.repacked = owners[m.weight.untyped_storage().data_ptr()].repacked
        if changed and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the rewrite's temporaries: hand them back before the KV sizing
        return {f"{m.out_features}x{m.in_features}": "repacked" if m.repacked else "standard" for m in decode}

    def _down_keys(self) -> set[tuple[int, int, torch.dtype]]:
        """(N, K, dtype) of the merged dense MLPs' plain down weights: the products decode_fusion's GLU form takes."""
        keys = set()
        for m in self.modules():
            w = _plain_weight(m.down_proj) if isinstance(m, Gemma4MLP) and m.merged_weight() is not None else None
            if w is not None and w.device.type != "meta":
                keys.add((w.shape[0], w.shape[1], w.dtype))
        return keys

    def set_fused(self, on: bool) -> None:
        """Route norms, GeGLU, q/k-norm + RoPE and MoE through the Triton kernels (True) or PyTorch (False).

        Switchable on a live model (A/B arms share the weights); both paths compute the same function (fp32 math
        inside the kernels, so bf16 results differ by rounding). CUDA graphs captured under one setting replay it.
        Switching on (re-)merges the q|k|v and gate|up weights into views of one tensor each (module docstring);
        switching off keeps the views, which the unfused path reads like any other weight.
        """
        on = bool(on)
        if on:
            _kernels()  # import triton now: fail here rather than inside a forward
        self.fused = on
        merged = False
        for m in self.modules():
            if isinstance(m, (RMSNorm, Gemma4MLP, Gemma4Attention, Gemma4Experts, Gemma4DecoderLayer)):
                m.fused = on
            if on and isinstance(m, (Gemma4MLP, Gemma4Attention)):
                merged |= m.merge_projections()  # no-op while the views from an earlier switch are intact
        if merged and self.device.type == "cuda":
            # the replaced q/k/v and gate/up tensors sit in torch's cache as free blocks: hand them back to the
            # driver, or the engine's KV sizing (free memory after a warmup) would miss them (31B: ~38 GB)
            torch.cuda.empty_cache()

    # ---- helpers -----------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def setup_rope(self, max_positions: int | None = None) -> None:
        """(Re)build the cos/sin tables; called once after the weights are materialised, grown on demand."""
        n = max_positions or min(self.cfg.max_position_embeddings, 8192)
        self.rope = RopeTables(self.cfg, n, self.device, self.dtype)

    def ensure_rope(self, num_positions: int) -> None:
        """Make the tables cover positions [0, num_positions) (grows by doubling; call from the host side)."""
        if self.rope is None or num_positions > self.rope.max_positions:
            have = 0 if self.rope is None else self.rope.max_positions
            self.setup_rope(max(num_positions, 2 * have, min(self.cfg.max_position_embeddings, 8192)))

    def _rope(self, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
        if self.rope is None:
            self.setup_rope()
        assert self.rope is not None
        if positions.device.type == "cpu" and positions.numel():  # no device sync on GPU: callers ensure_rope()
            self.ensure_rope(int(positions.max()) + 1)
        return self.rope.lookup(positions)

    def multimodal_mask(self, input_ids: Tensor) -> Tensor:
        """[T] bool: image/video placeholders (replaced by mm_embeds rows)."""
        return (input_ids == self.cfg.image_token_id) | (input_ids == self.cfg.video_token_id)

    # Table lookups and the LM head matmul, the only steps tensor parallelism changes: perfkit.runtime.tp overrides
    # these three with their vocab-sharded forms and inherits everything around them (mm merge, scales, soft-cap).
    def _token_embeddings(self, text_ids: Tensor) -> Tensor:
        """Unscaled rows of the token embedding table: [T] -> [T, H]."""
        return F.embedding(text_ids, self.embed_tokens.weight)

    def _per_layer_token_embeddings(self, text_ids: Tensor) -> Tensor:
        """Unscaled rows of the PLE table: [T] -> [T, L * P]."""
        return F.embedding(text_ids, self.embed_tokens_per_layer.weight)

    def _lm_head(self, x: Tensor) -> Tensor:
        """Normed final hidden [N, H] -> logits [N, V] in the model dtype (tied embedding as LM head)."""
        w = self.embed_tokens.weight
        tile = _gemv_tile(x, w, self.gemv_tiles) if self.fused else None
        if tile is not None:
            return _kernels(self.pdl).gemv(x, w, tile)
        return F.linear(x, w)

    def embed(self, input_ids: Tensor, mm_embeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """-> (h0 [T, H] with mm rows merged, text ids [T] with every MM placeholder replaced by pad)."""
        cfg = self.cfg
        mm = self.multimodal_mask(input_ids)
        placeholders = mm | (input_ids == cfg.audio_token_id)
        text_ids = torch.where(placeholders, cfg.pad_token_id, input_ids)
        scale = round_to(cfg.embed_scale, self.embed_tokens.weight.dtype)  # sqrt(H) rounded (bf16: 73.5)
        h = self._token_embeddings(text_ids) * scale  # [T, H]
        if mm_embeds is not None:
            n = int(mm.sum())
            if n != mm_embeds.shape[0]:
                raise ValueError(f"mm_embeds has {mm_embeds.shape[0]} rows for {n} image/video placeholder tokens")
            h = h.masked_scatter(mm[:, None], mm_embeds.to(h.dtype))
        return h, text_ids

    def per_layer_inputs(self, text_ids: Tensor, h0: Tensor) -> Tensor:
        """PLE (§2.3) -> [T, L, P]: (RMSNorm(h0 @ Wproj.T / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)."""
        cfg = self.cfg
        T, L, P = h0.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        scale = round_to(P**0.5, self.embed_tokens_per_layer.weight.dtype)
        tok = (self._per_layer_token_embeddings(text_ids) * scale).view(T, L, P)
        proj = (self.per_layer_model_projection(h0) * cfg.hidden_size**-0.5).view(T, L, P)
        proj = self.per_layer_projection_norm(proj)
        return (proj + tok) * 2.0**-0.5

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionBackend,
        mm_embeds: Tensor | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """input_ids/positions [T] long -> float32 logits [len(logits_indices) or T, V]."""
        h, text_ids = self.embed(input_ids, mm_embeds)  # [T, H]
        ple = self.per_layer_inputs(text_ids, h) if self.cfg.has_ple else None  # [T, L, P]
        rope = self._rope(positions)  # {is_sliding: (cos, sin) [T, hd/2]}
        h = self.decode_layers(h, rope, attn, ple)
        if logits_indices is not None:
            h = h[logits_indices]
        return self.logits(h)

    def decode_layers(
        self, h: Tensor, rope: dict[bool, tuple[Tensor, Tensor]], attn: AttentionBackend, ple: Tensor | None
    ) -> Tensor:
        """Every decoder layer: h [T, H] embeddings -> final hidden [T, H] (before the final norm). rope:
        {is_sliding: (cos, sin) [T, hd/2]}; ple [T, L, P] or None. The one layer loop of `forward` and of the
        CUDA-graph decode body. Fused: each layer's last sandwich also emits the next layer's input_layernorm
        output, so (h, normed h) pass from layer to layer and only the first layer runs its own rmsnorm."""
        if not self.fused:
            for i, layer in enumerate(self.layers):
                h = layer(h, rope[layer.is_sliding], attn, None if ple is None else ple[:, i])
            return h
        x: Tensor | None = None  # input_layernorm(h) of the layer about to run, from the previous layer
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm.weight if i + 1 < n else None
            h, x = layer.forward_fused(
                h, rope[layer.is_sliding], attn, None if ple is None else ple[:, i], x=x, next_norm=nxt
            )
        return h

    def logits(self, h: Tensor, out: Tensor | None = None, greedy: GreedyIds | None = None) -> Tensor:
        """[N, H] final hidden -> float32 soft-capped logits [N, V] (tied embedding as LM head).

        out: an fp32 [N, V] buffer to write them into, in place (same values, bit for bit). The decode graphs
        pass one static buffer shared by every captured size: each graph's own logits output stayed allocated
        as long as the graph, ~1 MiB per row, so batch sizes up to 1024 held ~33 GB (12-01c, 26B-A4B).
        greedy: with out, a `decode_io.GreedyIds` (toggle decode_io): one launch soft-caps into out and writes
        each row's argmax into greedy.ids, in place of the soft-cap's four launches and the sampler's argmax."""
        z = self._lm_head(self.norm(h))
        cap = self.cfg.final_logit_softcapping
        if out is None:
            logits = z.float()
            return torch.tanh(logits / cap) * cap if cap else logits
        if greedy is not None:
            return _kernels(self.pdl).softcap_argmax(z, cap, out, greedy)
        out.copy_(z)
        return out.div_(cap).tanh_().mul_(cap) if cap else out

    def decode_rows_apply(self) -> bool:
        """`decode_rows` can stand for `embed` + the RoPE lookup of a text decode step: the model's own table (not a
        vocab shard) and no per-layer inputs (PLE projects the embedding with a matmul; its models keep the torch
        ops)."""
        return self.own_lookups and not self.cfg.has_ple

    def decode_rows(
        self,
        input_ids: Tensor,
        positions: Tensor,
        h_out: Tensor,
        rope_out: dict[bool, tuple[Tensor, Tensor]],
        row_src: Tensor | None = None,
        prev_ids: Tensor | None = None,
    ) -> None:
        """A text decode step's inputs in one launch (perfkit/kernels/decode_io.py; toggle decode_io): h_out [B, H]
        = `embed(ids)[0]` and rope_out {is_sliding: (cos, sin) [B, hd/2]} = the RoPE rows of `positions`, bit for
        bit; ids = input_ids, or prev_ids[row_src] where row_src >= 0 (the runner's gather of sampled ids). Only
        where `decode_rows_apply`; the RoPE tables must cover the positions (`ensure_rope`)."""
        cfg = self.cfg
        w = self.embed_tokens.weight
        assert self.rope is not None
        keys = list(rope_out)
        _kernels(self.pdl).decode_rows(
            input_ids, positions, w, round_to(cfg.embed_scale, w.dtype),
            (cfg.pad_token_id, cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id), h_out,
            [self.rope.tables[k] for k in keys], [rope_out[k] for k in keys], row_src=row_src, prev_ids=prev_ids,
        )  # fmt: skip
