"""Weight quantisation of the Gemma4 decoder: FP8 (W8A8, e4m3) and NVFP4 (ModelOpt layout, W4A16 on Hopper).

What is quantised (``quantize_model_``): every ``nn.Linear`` inside the decoder layers (attention q/k/v/o, dense
MLP gate/up/down, PLE gate/projection of E2B/E4B) and the stacked MoE expert tensors (26B-A4B). Kept in the
model dtype: the token embedding, which is also the (tied) LM head, the PLE embedding table and
``per_layer_model_projection`` (outside the layers), norms, and the MoE router ``proj`` ([E, H], tiny, and its
rounding would move top-k routing decisions; ModelOpt's recipes also leave MoE gates unquantised). A Linear whose
dims do not fit the format (K % 16 for NVFP4, K and N % 16 for FP8) is left as is and listed in the report.

Modules are swapped by name from outside (``setattr`` on the parent); ``model.py`` is untouched. On the fused path
q|k|v and gate|up of a layer merge into one quantised GEMM each (``Fp8Linear.merge_rows`` / ``Nvfp4Linear.merge_rows``,
which ``model.merge_projections`` finds by duck typing).

Formats
-------
- ``fp8``: :class:`Fp8Linear` holds ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` fp32 [N] (per output
  channel, ``amax / 448``). Forward: per-token dynamic activation scales + ``torch._scaled_mm`` (row-wise
  scales) on sm_89+ (backend ``fp8-scaled-mm``); elsewhere the same numerics in torch (``fp8-ref``).
- ``nvfp4``: :class:`Nvfp4Linear` holds exactly the ModelOpt checkpoint tensors: ``weight`` uint8 [N, K/2]
  (e2m1 pairs, low nibble first), ``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2`` fp32 scalar
  (global), ``input_scale`` fp32 scalar (calibrated activation scale; 1.0 for random weights, only the native
  FP4 path would use it, and that path computes the activation global scale dynamically). Backends:
  ``w4a16-triton`` (sm_80/sm_90, and CPU under ``TRITON_INTERPRET=1``): :func:`w4a16_gemm`;
  ``fp4-native`` (sm_100+ with FlashInfer's ``mm_fp4``; never on sm_90); ``w4a16-ref`` (CPU without the
  interpreter): dequantise + matmul in torch. On w4a16-triton the words may be held repacked
  (``Nvfp4Linear.set_words``, toggle ``w4a16_words``): the same codes in another bit order inside each int32
  word, which the tensor-core gemv decodes in fewer instructions; ``state_dict`` still hands out the
  checkpoint's order.
- Experts (:class:`QuantizedExperts`): the stacked ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] in
  the same formats (NVFP4: one global scale per expert and per gate/up half, stored per row as
  ``*_weight_scale_2`` [E, N]). Decode (<= 64 token-slots): per-row-expert W4A16 kernel (no host sync) or a
  torch gather + dequant; prefill: tokens sorted by expert, one W4A16 GEMM per expert. FP8 experts are
  weight-only (dequantise on the fly, activations not quantised) so decode and prefill share numerics.

Loading ModelOpt NVFP4 checkpoints: :func:`load_nvfp4_checkpoint` (names ``<linear>.weight``, ``.weight_scale``,
``.weight_scale_2``, ``.input_scale``; experts either stacked ``experts.gate_up_proj`` +
``experts.gate_up_proj_weight_scale`` (+ ``_weight_scale_2``) or per expert ``experts.<e>.{gate,up,down}_proj.*``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from perfkit.errors import PerfkitError
from perfkit.kernels.fp8 import (
    dequantize_fp8_rowwise,
    fp8_linear,
    fp8_linear_ref,
    fp8_supported,
    quantize_fp8_rowwise,
)
from perfkit.kernels.fp8_gemv import fp8_gemv
from perfkit.kernels.fp8_gemv import pick_config as pick_fp8_gemv_config
from perfkit.kernels.launch import capability, interpreting
from perfkit.kernels.moe import QuantExpertWeights, fused_moe_quantized, gather_w4a16_fits, quantize_experts
from perfkit.kernels.w4a16_gemm import (
    GEMV_TC_MAX_M,
    dequantize_nvfp4,
    global_scale_runs,
    new_split_counter,
    pick_path,
    quantize_nvfp4,
    repack_pays,
    repack_words,
    unrepack_words,
    w4a16_gemm,
    w4a16_gemm_gathered,
)

SCHEMES = ("fp8", "nvfp4")
EXCLUDED_IN_LAYERS = ("router.proj",)  # names (relative to a decoder layer) kept in the model dtype

# --------------------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------------------


def _flashinfer_fp4() -> Any | None:
    """FlashInfer's FP4 GEMM entry points, or None (guarded import; only ever tried on sm_100+)."""
    try:
        import flashinfer  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    needed = ("mm_fp4", "fp4_quantize", "nvfp4_block_scale_interleave")
    return flashinfer if all(hasattr(flashinfer, n) for n in needed) else None


def nvfp4_backend(device: torch.device | str) -> str:
    """``fp4-native`` on sm_100+ with FlashInfer FP4; ``w4a16-triton`` on other CUDA GPUs (sm_90: always) and on
    CPU under the Triton interpreter; ``w4a16-ref`` on CPU otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        if capability(device) >= (10, 0) and _flashinfer_fp4() is not None:
            return "fp4-native"
        return "w4a16-triton"
    return "w4a16-triton" if interpreting() else "w4a16-ref"


def fp8_backend(device: torch.device | str) -> str:
    return "fp8-scaled-mm" if fp8_supported(device) else "fp8-ref"


def expert_backend(scheme: str, device: torch.device | str) -> str:
    """``QuantizedExperts.backend``: the Triton kernels (``w4a16-triton`` / ``fp8-triton``) on CUDA and on CPU
    under the interpreter, else torch dequantisation (``w4a16-ref`` / ``fp8-dequant``). NVFP4 experts use the
    W4A16 kernels on sm_100 too (FlashInfer's FP4 GEMM has no grouped form here)."""
    triton_ok = torch.device(device).type == "cuda" or interpreting()
    if scheme == "nvfp4":
        return "w4a16-triton" if triton_ok else "w4a16-ref"
    return "fp8-triton" if triton_ok else "fp8-dequant"


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------------------------------------------
# Quantised linear modules
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergedQuantRows:
    """One quantised [sum N_i, K] linear (``module``, an Fp8Linear / Nvfp4Linear) whose row slices are the weight
    buffers of the merged modules (views, so the weights exist once), as ``model.MergedRows`` for nn.Linear: one
    GEMM launch for q|k|v or gate|up instead of 2-3. The math per output row is unchanged: FP8 rows keep their
    per-channel scales (and W8A8 quantises the shared input once, with the same per-token scale); NVFP4 rows keep
    their block scales and carry their module's global scale as a per-row vector (copied at merge time: weights
    loaded into the modules afterwards by ``copy_`` reach the merged weight through the views, a changed global
    scale does not; load before ``set_fused(True)``, as the engine does)."""

    module: nn.Module
    parts: tuple[tuple[nn.Module, int], ...]  # (linear, data_ptr of its weight view)

    @property
    def weight(self) -> Tensor:
        return self.module.weight

    def __call__(self, x: Tensor) -> Tensor:
        return self.module(x)

    def intact(self, linears: list[nn.Module]) -> bool:
        """True while the same modules still hold views of the merged weight (see ``model.MergedRows.intact``)."""
        if len(linears) != len(self.parts):
            return False
        return all(m is pm and m._buffers.get("weight") is not None and m._buffers["weight"].data_ptr() == ptr
                   for m, (pm, ptr) in zip(linears, self.parts, strict=True))  # fmt: skip


def _merge_quant_rows(linears: list[nn.Module], names: tuple[str, ...], merged: nn.Module) -> MergedQuantRows:
    """Concatenate the row-indexed buffers ``names`` of ``linears`` into ``merged`` and re-point each module's
    buffers at its rows of them."""
    with torch.no_grad():
        for name in names:
            setattr(merged, name, torch.cat([getattr(m, name) for m in linears], dim=0))
        row = 0
        for m in linears:
            n = m.out_features
            for name in names:
                setattr(m, name, getattr(merged, name)[row : row + n])
            row += n
    return MergedQuantRows(merged, tuple((m, m.weight.data_ptr()) for m in linears))


def _mergeable(linears: list[nn.Module], cls: type) -> bool:
    return (
        bool(linears)
        and all(type(m) is cls for m in linears)
        and len({(m.in_features, m.backend, m.weight.device) for m in linears}) == 1
        and linears[0].weight.device.type != "meta"
    )


def _tc_split_counter(m: nn.Module) -> Tensor | None:
    """The int32 counter of ``m``'s weight for the tensor-core gemv at small M (its split-K partials summed in the
    same launch; ``w4a16_gemm(split_counter=)``, ``fp8_gemv(split_counter=)``), made on the first call outside a
    CUDA-graph capture (the engine's eager warmup) and kept in ``m._split_counter``; the kernel leaves it at zero,
    and one module never runs twice at once. None while capturing before that: a second launch sums the splits."""
    c, w = m._split_counter, m.weight
    if c is None or c.device != w.device:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        c = m._split_counter = new_split_counter(m.out_features, w.device)
    return c


class Fp8Linear(nn.Module):
    """Drop-in for a bias-free ``nn.Linear``: e4m3 weight [N, K] + fp32 per-channel scales [N].

    Backend ``fp8-scaled-mm``: decode rows take the weight-only Triton GEMV (:func:`perfkit.kernels.fp8_gemv.fp8_gemv`:
    x not quantised, the weight streamed once; ``fp8_gemv.pick_config``: M = 1 everywhere, M 2-32 of bf16 x on the
    tensor-core form on sm_90+), because at small M the per-token activation quantisation (several tiny kernels per
    linear) plus ``_scaled_mm`` made FP8 decode slower than bf16 on the H200 (31B batch 1: 21.0 vs 16.7 ms TPOT;
    batch 4: 21.31 vs 17.86). Larger M: W8A8 (per-token scales + ``torch._scaled_mm``), or the torch weight-only
    reference with ``quantize_input=False``. Backend ``fp8-ref``: the torch reference at every M."""

    pdl = False  # the GEMV launches with programmatic dependent launch (``Gemma4Model.set_pdl``, toggle ``pdl``)

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.backend = "fp8-ref"
        self.quantize_input = True  # False: weight-only (W8A16) numerics, for accuracy studies
        self._split_counter: Tensor | None = None  # the tensor-core gemv's split-K count (``_tc_split_counter``)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Fp8Linear:
        m = cls(lin.in_features, lin.out_features, device=lin.weight.device)
        m.weight, m.weight_scale = quantize_fp8_rowwise(lin.weight.detach())
        m.backend = fp8_backend(lin.weight.device)
        return m

    @classmethod
    def merge_rows(cls, linears: list[nn.Module]) -> MergedQuantRows | None:
        """q|k|v or gate|up as one Fp8Linear (None, nothing changed, unless all are Fp8Linear of one backend,
        in_features and input mode)."""
        if not _mergeable(linears, cls) or len({m.quantize_input for m in linears}) != 1:
            return None
        merged = cls(linears[0].in_features, sum(m.out_features for m in linears), device="meta")
        merged.backend, merged.quantize_input = linears[0].backend, linears[0].quantize_input
        return _merge_quant_rows(linears, ("weight", "weight_scale"), merged)

    def dequantized_weight(self) -> Tensor:
        return dequantize_fp8_rowwise(self.weight, self.weight_scale)

    def forward(self, x: Tensor) -> Tensor:
        x2 = _flat(x)
        gemv = None
        if self.backend == "fp8-scaled-mm":
            gemv = pick_fp8_gemv_config(x2.shape[0], self.out_features, self.in_features, x2)
        if gemv is not None:  # decode rows: weight-only GEMV
            counter = _tc_split_counter(self) if gemv.tc else None
            y = fp8_gemv(x2, self.weight, self.weight_scale, config=gemv, pdl=self.pdl, split_counter=counter)
        elif self.backend == "fp8-scaled-mm" and self.quantize_input:
            y = fp8_linear(x2, self.weight, self.weight_scale)
        else:
            y = fp8_linear_ref(x2, self.weight, self.weight_scale, quantize_input=self.quantize_input)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"


class Nvfp4Linear(nn.Module):
    """Drop-in for a bias-free ``nn.Linear`` holding the ModelOpt NVFP4 tensors (names = checkpoint names)."""

    # Prefill-sized calls (the dequant_mm path) pass the global scale as cached host runs, applied as cuBLAS's
    # alpha (``w4a16_gemm(gs_runs=)``), instead of an fp32 [M, N] epilogue pass. H200 12-01i
    # (test_gpu_w4a16_prefill_alpha_runs, the 31B gate|up at 8,192 tokens): 2.696 ms against 3.296 ms (-18 %).
    prefill_alpha = True
    # The decode-sized gemv kernels launch with programmatic dependent launch (``Gemma4Model.set_pdl``, toggle ``pdl``).
    pdl = False

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        if in_features % 16:
            raise ValueError(f"NVFP4 needs in_features % 16 == 0, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        N, K = out_features, in_features
        self.register_buffer("weight", torch.empty(N, K // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(N, K // 16, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        self.backend = "w4a16-ref"
        self._native: tuple[Tensor, Tensor] | None = None  # (swizzled block scales, ...) prepared lazily
        self._gs_runs_cache: tuple[tuple, tuple[tuple[int, int, float], ...]] | None = None  # (key, runs)
        self._split_counter: Tensor | None = None  # the tensor-core gemv's split-K count (``_one_row_counter``)
        self.repacked = False  # ``weight`` holds its words in ``repack_words``' order (``set_words``)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Nvfp4Linear:
        m = cls(lin.in_features, lin.out_features, device=lin.weight.device)
        m.weight, m.weight_scale, gs = quantize_nvfp4(lin.weight.detach())
        m.weight_scale_2 = gs.reshape(())
        m.backend = nvfp4_backend(lin.weight.device)
        return m

    @classmethod
    def merge_rows(cls, linears: list[nn.Module]) -> MergedQuantRows | None:
        """q|k|v or gate|up as one Nvfp4Linear with a per-row global scale (None, nothing changed, unless all are
        Nvfp4Linear of one backend and in_features; fp4-native keeps separate GEMMs: its alpha is a scalar)."""
        if not _mergeable(linears, cls) or linears[0].backend == "fp4-native" or len({m.repacked for m in linears}) > 1:
            return None
        merged = cls(linears[0].in_features, sum(m.out_features for m in linears), device="meta")
        merged.backend, merged.input_scale = linears[0].backend, linears[0].input_scale
        merged.repacked = linears[0].repacked  # a row concatenation keeps each word whole
        with torch.no_grad():  # each module's global scale, one per row of the merged weight
            merged.weight_scale_2 = torch.cat(
                [m.weight_scale_2.float().reshape(-1).expand(m.out_features) for m in linears]
            )
        return _merge_quant_rows(linears, ("weight", "weight_scale"), merged)

    def dequantized_weight(self) -> Tensor:
        return dequantize_nvfp4(self.standard_weight(), self.weight_scale, self.weight_scale_2)

    def standard_weight(self) -> Tensor:
        """``weight`` in the checkpoint's word order (a copy if it is held repacked)."""
        return unrepack_words(self.weight) if self.repacked else self.weight

    def repack_pays(self) -> bool:
        """Whether this weight's batch-1 product runs faster on repacked words here (``w4a16_gemm.repack_pays``)."""
        return self.backend == "w4a16-triton" and repack_pays(self.out_features, self.in_features, self.weight.device)

    def set_words(self, repacked: bool) -> bool:
        """Rewrite ``weight`` in place in ``repack_words``' order (True) or back to the checkpoint's (False), the
        same codes moved inside each int32 word: the tensor-core gemv decodes a repacked word with rotations (fewer
        instructions), every W4A16 path reads either order with the same result bit for bit. In place, so that no
        second copy is held and views of these rows (the separate q / k / v, gate / up modules of a merged weight)
        see it: the caller sets their ``repacked`` too (``Gemma4ForCausalLM.set_w4a16_words``). Only the
        w4a16-triton backend reads repacked words. Returns whether the words changed."""
        repacked = bool(repacked) and self.backend == "w4a16-triton"
        if repacked == self.repacked:
            return False
        with torch.no_grad():
            self.weight.copy_(repack_words(self.weight) if repacked else unrepack_words(self.weight))
        self.repacked = repacked
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Checkpoints and ``state_dict()`` hold the standard words. ``keep_vars=True`` hands out the live buffer as
        it is (the loaders that ``copy_`` into it run before the engine repacks)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.repacked and not keep_vars:
            destination[prefix + "weight"] = unrepack_words(self.weight)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A state dict's standard words are stored in this module's order."""
        key = prefix + "weight"
        src = state_dict.get(key)
        if self.repacked and src is not None and src.shape == self.weight.shape:
            state_dict = {**state_dict, key: repack_words(src.to(self.weight.device))}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _gs_runs(self) -> tuple[tuple[int, int, float], ...] | None:
        """The global scale as host runs for the prefill GEMM's cuBLAS alpha (``w4a16_gemm(gs_runs=)``), read from
        the device on the first prefill-sized call (the engine's warmup) and again only when ``weight_scale_2`` is
        replaced or written in place (a checkpoint load), so the step path does not sync."""
        gs = self.weight_scale_2
        key = (gs.data_ptr(), gs._version, gs.numel())
        cached = self._gs_runs_cache
        if cached is None or cached[0] != key:
            if gs.is_cuda and torch.cuda.is_current_stream_capturing():
                return None  # no sync inside a graph capture: the fp32 epilogue, which reads gs on the device
            cached = (key, global_scale_runs(gs, self.out_features))
            self._gs_runs_cache = cached
        return cached[1]

    def forward(self, x: Tensor) -> Tensor:
        x2 = _flat(x)
        if self.backend == "w4a16-triton":
            path = pick_path(x2.shape[0])
            runs = self._gs_runs() if self.prefill_alpha and path == "dequant_mm" else None
            counter = _tc_split_counter(self) if x2.shape[0] <= GEMV_TC_MAX_M and x2.is_cuda else None
            y = w4a16_gemm(x2, self.weight, self.weight_scale, self.weight_scale_2, gs_runs=runs,
                           split_counter=counter, pdl=self.pdl, repacked=self.repacked)  # fmt: skip
        elif self.backend == "fp4-native":
            y = self._forward_native(x2)
        else:
            y = (x2.float() @ self.dequantized_weight().T).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_native(self, x: Tensor) -> Tensor:
        """Blackwell: NVFP4 activations (dynamic global scale) x NVFP4 weights through FlashInfer ``mm_fp4``.
        Written against FlashInfer's documented API; not run on hardware by the author (no sm_100 here)."""
        fi = _flashinfer_fp4()
        assert fi is not None
        if self._native is None:
            sf = fi.nvfp4_block_scale_interleave(_pad_rows(self.weight_scale.view(torch.uint8), 128))
            self._native = (sf, self.weight)
        sf_w, w = self._native
        x_gs = (448.0 * 6.0) / x.float().abs().amax().clamp(min=1e-12)  # 1 / activation global scale
        xq, sf_x = fi.fp4_quantize(x.to(torch.bfloat16), x_gs, 16, False, True)
        alpha = (self.weight_scale_2 / x_gs).reshape(1)
        y = fi.mm_fp4(xq, w.T, sf_x, sf_w.T, alpha, torch.bfloat16, block_size=16)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        words = ", words=repacked" if self.repacked else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}{words}"


def _pad_rows(t: Tensor, multiple: int) -> Tensor:
    pad = (-t.shape[0]) % multiple
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


# --------------------------------------------------------------------------------------------------------------
# Quantised MoE experts
# --------------------------------------------------------------------------------------------------------------


class QuantizedExperts(nn.Module):
    """Replacement for ``Gemma4Experts`` with quantised stacked weights; same forward signature
    ``(x [T, H], idx [T, K], w [T, K]) -> [T, H]``.

    Backends (``expert_backend``): ``w4a16-triton`` (NVFP4) runs the two NVFP4 gather kernels up to
    ``gather_kernels_max_rows`` pairs with bf16 x (else the W4A16 gemv gather up to ``gather_max_rows``) and the
    grouped, in-register-dequantising Triton GEMMs of ``fused_moe_quantized`` above; ``fp8-triton`` runs those
    grouped GEMMs at every size. Both are sync-free, so decode graphs capture at every batch. (Until 12-01 the
    sorted side looped over the 128 experts with a host sync: 26B-A4B NVFP4 decode at c64 took 1.33 s per step and
    no graph above batch 8 captured.)
    ``w4a16-ref`` / ``fp8-dequant`` (CPU without the interpreter) dequantise in torch, a loop over the experts."""

    gather_max_rows = 64
    # w4a16-triton at or below gather_kernels_max_rows pairs, bf16 x: the two NVFP4 gather kernels of
    # ``fused_moe_quantized(path="gather")`` instead of the gemv + torch GeGLU + combine above. Set per model by the
    # toggle moe_gather (``Gemma4ForCausalLM.set_moe_gather``), default kernels since the H200 A/B of 12-01f
    # (configs/ab_moe_gather.yaml, 26B-A4B NVFP4: TPOT c1 4.07 -> 3.50 ms, c8 10.51 -> 7.48 ms)
    gather_kernels = True
    # The gather kernels' own limit in pairs: where they stop beating the sorted grouped GEMMs. H200 sweep at
    # 26B-A4B shapes (12-01g, docs/h200-runs/2026-12-01g/2-moe_quant_sweep_T.txt; one MoE layer, CUDA graph, L2
    # flushed, gather vs sorted): T = 8 116 vs 263 us, 16 202 vs 368, 32 372 vs 489, 48 542 vs 530, 64 710 vs 542.
    # 256 = T 32 at top-8, the largest measured T where gather still wins by a margin (24 %).
    gather_kernels_max_rows = 256
    # Toggle moe_prefill (``Gemma4ForCausalLM.set_moe_prefill``): at or above dequant_min_pairs routed pairs the
    # Triton backends run ``fused_moe_quantized(path="dequant")``, every expert dequantised into a bf16 scratch
    # and the bf16 grouped GEMMs (prefill is compute-bound; 26B-A4B NVFP4 prefill steps ran 234 ms through the
    # in-register GEMMs against 132 ms with bf16 weights, H200 12-01h). One 26B-A4B layer on the H200 (12-01i,
    # ``python3 -m perfkit.kernels.moe --sweep --quant nvfp4``, sorted vs dequant): T = 512 0.76 vs 1.02 ms,
    # 1024 1.10 vs 1.14, 8192 5.50 vs 3.07; on 12-02 (docs/h200-runs/2026-12-02/1-moe_nvfp4_cross.jsonl) T = 1536
    # 1.446 vs 1.265, 2048 1.717 vs 1.369, 4096 2.946 vs 1.927. So they cross between T = 1024 and 1536; 12288 pairs
    # (T = 1536 at top-8) is the first measured point where dequant wins. prefill_dequant None (moe_prefill=auto,
    # the default): the dequant path for NVFP4 experts, since configs/ab_moe_prefill.yaml on the H200 (12-01i: 8K
    # forward_prefill -25.8 %, c64 output +24.4 %), the in-register GEMMs for FP8 experts, whose decode is a cast:
    # their dequant path lost at every size timed (12-02, 1-moe_fp8_cross.jsonl: T = 512 2.723 vs 0.487 ms, 8192
    # 4.625 vs 2.998 ms; the FP8 -> bf16 copy of every expert costs more than it saves). True / False force either
    # path.
    prefill_dequant: bool | None = None
    dequant_min_pairs = 12288

    @property
    def fused(self) -> bool:
        """Sync-free at every batch size (the Triton backends). Read by ``tp._ExpertParallel``, as it reads
        ``Gemma4Experts.fused``: another rank's pairs then stay in the batch at weight 0 instead of being dropped
        through a host sync (``nonzero``), which no decode graph above 64 pairs could capture."""
        return getattr(self, "backend", None) in ("w4a16-triton", "fp8-triton")

    def __init__(self, scheme: str, E: int, H: int, Im: int, device: torch.device | str | None = None):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme {scheme!r}: allowed values are {', '.join(SCHEMES)}")
        self.scheme, self.num_experts, self.hidden, self.intermediate = scheme, E, H, Im
        for name, (N, K) in {"gate_up_proj": (2 * Im, H), "down_proj": (H, Im)}.items():
            if scheme == "nvfp4":
                self.register_buffer(name, torch.empty(E, N, K // 2, dtype=torch.uint8, device=device))
                self.register_buffer(
                    f"{name}_weight_scale", torch.empty(E, N, K // 16, dtype=torch.float8_e4m3fn, device=device)
                )
                self.register_buffer(f"{name}_weight_scale_2", torch.ones(E, N, dtype=torch.float32, device=device))
            else:
                self.register_buffer(name, torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=device))
                self.register_buffer(f"{name}_weight_scale", torch.empty(E, N, dtype=torch.float32, device=device))
        self.backend = "fp8-dequant" if scheme == "fp8" else "w4a16-ref"

    @classmethod
    def from_experts(cls, experts: nn.Module, scheme: str) -> QuantizedExperts:
        gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
        E, two_i, H = gu.shape
        Im = two_i // 2
        m = cls(scheme, E, H, Im, device=gu.device)
        for name, wq in zip(("gate_up_proj", "down_proj"), quantize_experts(gu, dn, scheme), strict=True):
            setattr(m, name, wq.values)  # the inverse of quant_weights
            if scheme == "nvfp4":
                setattr(m, f"{name}_weight_scale", wq.block_scale)
                setattr(m, f"{name}_weight_scale_2", wq.row_scale)
            else:
                setattr(m, f"{name}_weight_scale", wq.row_scale)
        m.backend = expert_backend(scheme, gu.device)
        return m

    def quant_weights(self, name: str) -> QuantExpertWeights:
        """``gate_up_proj`` / ``down_proj`` as the grouped kernels' :class:`QuantExpertWeights` (views, no copy)."""
        if self.scheme == "nvfp4":
            return QuantExpertWeights(
                "nvfp4", getattr(self, name), getattr(self, f"{name}_weight_scale"),
                getattr(self, f"{name}_weight_scale_2"),
            )  # fmt: skip
        return QuantExpertWeights("fp8", getattr(self, name), None, getattr(self, f"{name}_weight_scale"))

    def _dequant(self, name: str, e: Tensor | int) -> Tensor:
        """fp32 weights of expert(s) ``e`` (an index or an index tensor): [..., N, K]."""
        q, s = getattr(self, name)[e], getattr(self, f"{name}_weight_scale")[e]
        if self.scheme == "fp8":
            return dequantize_fp8_rowwise(q, s)
        return dequantize_nvfp4(q, s, getattr(self, f"{name}_weight_scale_2")[e])

    def dequantized_weights(self) -> dict[str, Tensor]:
        all_e = torch.arange(self.num_experts, device=self.gate_up_proj.device)
        return {name: self._dequant(name, all_e) for name in ("gate_up_proj", "down_proj")}

    def _mm(self, name: str, x: Tensor, e: int) -> Tensor:  # x [n, K] against expert e -> [n, N], torch
        return (x.float() @ self._dequant(name, e).T).to(x.dtype)

    def _mm_rows(self, name: str, x: Tensor, ids: Tensor) -> Tensor:  # row r against expert ids[r]
        if self.scheme == "nvfp4" and self.backend == "w4a16-triton":
            return w4a16_gemm_gathered(
                x, getattr(self, name), getattr(self, f"{name}_weight_scale"),
                getattr(self, f"{name}_weight_scale_2"), ids,
            )  # fmt: skip
        return (self._dequant(name, ids) @ x.float()[:, :, None])[:, :, 0].to(x.dtype)

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        pairs = idx.numel()
        if self.backend == "w4a16-triton" and self.gather_kernels and pairs <= self.gather_kernels_max_rows:
            gu = self.quant_weights("gate_up_proj")
            if gather_w4a16_fits(x, gu):
                return fused_moe_quantized(x, gu, self.quant_weights("down_proj"), w, idx, path="gather")
        small = pairs <= self.gather_max_rows
        if self.backend == "fp8-triton" or (self.backend == "w4a16-triton" and not small):
            dequant = self.backend == "w4a16-triton" if self.prefill_dequant is None else self.prefill_dequant
            path = "dequant" if dequant and pairs >= self.dequant_min_pairs else "sorted"
            gu, dn = self.quant_weights("gate_up_proj"), self.quant_weights("down_proj")
            return fused_moe_quantized(x, gu, dn, w, idx, path=path)
        if small:
            return self.forward_gather(x, idx, w)
        return self.forward_sorted(x, idx, w)

    def _act(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_gather(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(K, dim=0)  # [T*K, H]
        y = self._mm_rows("down_proj", self._act(self._mm_rows("gate_up_proj", xs, flat)), flat)
        y = (y * w.reshape(-1, 1)).to(x.dtype)
        return y.view(T, K, -1).sum(dim=1)

    def forward_sorted(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """The torch path (the ``-ref`` / ``-dequant`` backends; tests compare the Triton backends to it): a loop
        over the routed experts, dequantised in fp32."""
        T, K = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync (as Gemma4Experts)
        token = order // K
        xs = x[token]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = xs[start : start + n]
                ys[start : start + n] = self._mm("down_proj", self._act(self._mm("gate_up_proj", seg, e)), e)
                start += n
        ys = (ys * w.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def extra_repr(self) -> str:
        return (
            f"scheme={self.scheme}, experts={self.num_experts}, hidden={self.hidden}, "
            f"intermediate={self.intermediate}, backend={self.backend}"
        )


# --------------------------------------------------------------------------------------------------------------
# Model-level quantisation
# --------------------------------------------------------------------------------------------------------------


@dataclass
class QuantReport:
    scheme: str
    backend: str  # linear layers
    expert_backend: str | None  # MoE experts (None: no MoE)
    quantized_bytes_before: int  # bytes of the tensors that were quantised, in the original dtype
    quantized_bytes_after: int  # bytes of their quantised replacements (values + all scales)
    model_bytes_before: int
    model_bytes_after: int
    num_linear: int
    num_expert_modules: int
    kept: list[str] = field(default_factory=list)  # decoder-layer linears left unquantised (with the reason)

    @property
    def compression(self) -> float:
        return self.quantized_bytes_before / max(self.quantized_bytes_after, 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compression": self.compression}


def _tensor_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def _decoder_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent module, attribute, linear) for every nn.Linear inside model.layers."""
    for i, layer in enumerate(model.layers):
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear):
                parent_name, _, attr = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                yield f"layers.{i}.{name}", parent, attr, mod


def _is_excluded(full_name: str) -> bool:
    return any(full_name.endswith(x) for x in EXCLUDED_IN_LAYERS)


def _fits(scheme: str, lin: nn.Linear) -> str | None:
    if lin.bias is not None:
        return "has a bias"
    if lin.in_features % 16:
        return f"in_features {lin.in_features} % 16 != 0"
    if scheme == "fp8" and lin.out_features % 16:
        return f"out_features {lin.out_features} % 16 != 0"
    return None


@torch.no_grad()
def quantize_model_(model: nn.Module, scheme: str, include_experts: bool = True) -> QuantReport:
    """Quantise the decoder layers of a Gemma4ForCausalLM in place (module swap) from its current weights;
    returns the report (also stored as ``model.quant_report``). See the module docstring for what is kept."""
    if scheme not in SCHEMES:
        raise PerfkitError(f"quant scheme {scheme!r}: allowed values are {', '.join(SCHEMES)}")
    if getattr(model, "quant_report", None) is not None:
        raise PerfkitError(f"model is already quantised ({model.quant_report.scheme})")
    device = next(model.parameters()).device
    model_before = _tensor_bytes(model)
    before = after = n_lin = n_exp = 0
    kept: list[str] = []
    make = Fp8Linear.from_linear if scheme == "fp8" else Nvfp4Linear.from_linear
    for full, parent, attr, lin in _decoder_linears(model):
        if _is_excluded(full):
            kept.append(f"{full} (excluded: MoE router)")
            continue
        why = _fits(scheme, lin)
        if why:
            kept.append(f"{full} ({why})")
            continue
        q = make(lin)
        before += _tensor_bytes(lin)
        after += _tensor_bytes(q)
        setattr(parent, attr, q)
        n_lin += 1
    experts_backend = None
    if include_experts:
        for layer in model.layers:
            experts = getattr(layer, "experts", None)
            if experts is None or isinstance(experts, QuantizedExperts):
                continue
            q = QuantizedExperts.from_experts(experts, scheme)
            before += _tensor_bytes(experts)
            after += _tensor_bytes(q)
            layer.experts = q
            experts_backend = q.backend
            n_exp += 1
    report = QuantReport(
        scheme=scheme,
        backend=fp8_backend(device) if scheme == "fp8" else nvfp4_backend(device),
        expert_backend=experts_backend,
        quantized_bytes_before=before,
        quantized_bytes_after=after,
        model_bytes_before=model_before,
        model_bytes_after=_tensor_bytes(model),
        num_linear=n_lin,
        num_expert_modules=n_exp,
        kept=kept,
    )
    model.quant_report = report
    return report


def apply_quant(model: nn.Module, scheme: str) -> QuantReport | None:
    """What the runner calls for ``ModelConfig.quant``: ``bf16`` -> nothing (None); ``fp8`` | ``nvfp4`` ->
    quantise the (random / bf16-loaded) weights in place, or, when the model was already loaded quantised
    (:func:`load_nvfp4_checkpoint`), return its report after checking the scheme matches."""
    if scheme == "bf16":
        return None
    existing = getattr(model, "quant_report", None)
    if existing is not None:
        if existing.scheme != scheme:
            raise PerfkitError(f"model is already quantised as {existing.scheme}, config asks for {scheme}")
        return existing
    return quantize_model_(model, scheme)


@torch.no_grad()
def dequantized_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """fp32 dequantised weights of every quantised module under their ORIGINAL parameter names
    (``layers.0.self_attn.q_proj.weight``, ``layers.0.experts.gate_up_proj``): load them into an unquantised
    model of the same config to get the reference the quantised model should reproduce."""
    out: dict[str, Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (Fp8Linear, Nvfp4Linear)):
            out[f"{name}.weight"] = mod.dequantized_weight()
        elif isinstance(mod, QuantizedExperts):
            for p, w in mod.dequantized_weights().items():
                out[f"{name}.{p}"] = w
    return out


@torch.no_grad()
def load_dequantized_(ref_model: nn.Module, quantized_model: nn.Module) -> None:
    """Copy ``dequantized_state_dict(quantized_model)`` into the unquantised ``ref_model`` (cast to its dtype)."""
    params = dict(ref_model.named_parameters())
    for name, w in dequantized_state_dict(quantized_model).items():
        params[name].copy_(w)


# --------------------------------------------------------------------------------------------------------------
# ModelOpt NVFP4 checkpoints
# --------------------------------------------------------------------------------------------------------------

_EXPERT_PROJ = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def is_modelopt_nvfp4(path: str | Path) -> bool:
    """True if the checkpoint declares ModelOpt NVFP4 (config.json quantization_config or hf_quant_config.json)."""
    import json  # noqa: PLC0415

    p = Path(path)
    cands = []
    if (p / "config.json").exists():
        cands.append(json.loads((p / "config.json").read_text()).get("quantization_config") or {})
    if (p / "hf_quant_config.json").exists():
        cands.append(json.loads((p / "hf_quant_config.json").read_text()).get("quantization") or {})
    return any(str(c.get("quant_algo", "")).upper() == "NVFP4" for c in cands)


@torch.no_grad()
def load_nvfp4_checkpoint(
    path: str | Path, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, cfg: Any = None
) -> nn.Module:
    """Build a Gemma4ForCausalLM from a ModelOpt NVFP4 HF checkpoint: a decoder Linear with a
    ``<name>.weight_scale`` tensor becomes an :class:`Nvfp4Linear` (its four tensors copied as stored), the rest
    loads as in ``weights.load_hf_weights_``. Sets ``model.quant_report``."""
    from perfkit.runtime.model import Gemma4ForCausalLM  # noqa: PLC0415
    from perfkit.runtime.model_config import from_hf_config  # noqa: PLC0415
    from perfkit.runtime.weights import load_hf_state  # noqa: PLC0415

    state = load_hf_state(path)
    cfg = cfg or from_hf_config(state.config, name=Path(path).name)
    device = torch.device(device)
    model = Gemma4ForCausalLM(cfg, device="meta", dtype=dtype)
    n_lin = n_exp = 0
    kept: list[str] = []
    for full, parent, attr, lin in _decoder_linears(model):
        if state.text_name(f"{full}.weight_scale") is None:
            kept.append(f"{full} (not quantised in the checkpoint)")
            continue
        setattr(parent, attr, Nvfp4Linear(lin.in_features, lin.out_features, device="meta"))
        n_lin += 1
    per_expert: set[str] = set()
    for i, layer in enumerate(model.layers):
        experts = getattr(layer, "experts", None)
        if experts is None:
            continue
        prefix = f"layers.{i}.experts"
        stacked = state.text_name(f"{prefix}.gate_up_proj_weight_scale") is not None
        unfused = state.text_name(f"{prefix}.0.gate_proj.weight_scale") is not None
        if not (stacked or unfused):
            continue
        E, two_i, H = experts.gate_up_proj.shape
        layer.experts = QuantizedExperts("nvfp4", E, H, two_i // 2, device="meta")
        if unfused:
            per_expert.add(prefix)
        n_exp += 1
    model.to_empty(device=device)
    model.requires_grad_(False)
    for name, t in model.state_dict(keep_vars=True).items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in per_expert:
            _load_per_expert(state, prefix, leaf, t)
            continue
        key = state.text_name(name)
        if key is None:
            if leaf == "input_scale":  # optional (weight-only exports)
                t.fill_(1.0)
                continue
            raise PerfkitError(f"checkpoint {state.path}: missing tensor {name} (shape {list(t.shape)})")
        src = state[key]
        if src.numel() != t.numel():
            raise PerfkitError(f"checkpoint {state.path}: {key} has shape {list(src.shape)}, expected {list(t.shape)}")
        t.copy_(src.reshape(t.shape))
    for mod in model.modules():
        if isinstance(mod, Nvfp4Linear):
            mod.backend = nvfp4_backend(device)
        elif isinstance(mod, QuantizedExperts):
            mod.backend = expert_backend("nvfp4", device)
    model.eval()
    model.setup_rope()
    model.quant_report = QuantReport(
        scheme="nvfp4", backend=nvfp4_backend(device),
        expert_backend=expert_backend("nvfp4", device) if n_exp else None,
        quantized_bytes_before=0, quantized_bytes_after=0, model_bytes_before=0,
        model_bytes_after=_tensor_bytes(model), num_linear=n_lin, num_expert_modules=n_exp, kept=kept,
    )  # fmt: skip
    return model


def _load_per_expert(state: Any, prefix: str, leaf: str, t: Tensor) -> None:
    """Fill a stacked QuantizedExperts buffer from per-expert ``<prefix>.<e>.<proj>.<tensor>`` checkpoint keys."""
    if leaf.endswith("_weight_scale"):
        base, suffix = leaf[: -len("_weight_scale")], "weight_scale"
    elif leaf.endswith("_weight_scale_2"):
        base, suffix = leaf[: -len("_weight_scale_2")], "weight_scale_2"
    else:
        base, suffix = leaf, "weight"
    projs = _EXPERT_PROJ[base]
    E = t.shape[0]
    rows = t.shape[1] // len(projs)
    for e in range(E):
        for j, proj in enumerate(projs):
            key = state.text_name(f"{prefix}.{e}.{proj}.{suffix}")
            if key is None:
                raise PerfkitError(f"checkpoint {state.path}: missing tensor {prefix}.{e}.{proj}.{suffix}")
            src = state[key]
            dst = t[e, j * rows : (j + 1) * rows]
            dst.copy_(src.reshape(-1).expand(rows) if suffix == "weight_scale_2" else src.reshape(dst.shape))


__all__ = [
    "Fp8Linear",
    "Nvfp4Linear",
    "QuantReport",
    "QuantizedExperts",
    "apply_quant",
    "dequantized_state_dict",
    "fp8_backend",
    "is_modelopt_nvfp4",
    "load_dequantized_",
    "load_nvfp4_checkpoint",
    "nvfp4_backend",
    "quantize_model_",
]
