"""The decode graphs' input and output launches: token rows in, soft-capped logits and greedy ids out.

Why: around each CUDA-graph replay the decode step ran ~25 small torch launches of its own, each 1-8 us of a
device that has nothing else to do at batch 1. In the H200 profile of 26B-A4B batch 1 (12-19,
``docs/h200-runs/2026-12-19/1-p26.trace.json.xz``; step 2.71 ms, bound 1.83 ms) they took per step:

- before the replay (``DecodeGraphs._prologue``): the embedding (placeholder ids to pad, the lookup, the sqrt(H)
  scale: 9 launches, 23.7 us) and the copies into the graph's static rows with the RoPE lookups of both tables
  (9 launches, 22.7 us);
- after the LM head (the graph's tail and the engine's sampling): the soft-cap (copy to fp32, scale, tanh, scale:
  4 launches, 9.7 us) and the argmax (a memset and torch's reduction, 13.9 us).

Two launches replace them:

- :func:`decode_rows` (``_decode_rows_kernel``), grid ``(B, 1 + tables)``: program ``(b, 0)`` writes row b of the
  graph's hidden input, ``emb[id'] * scale`` with ``id' = pad`` for image / video / audio placeholders (what
  ``Gemma4ForCausalLM.embed`` does for a text step), program ``(b, 1 + t)`` copies the cos / sin rows of position b
  of RoPE table t into the graph's static rows. With ``row_src`` the row's token is first taken from the previous
  step's sampled ids where the runner would have gathered it (2 more launches). Since the step's host inputs arrive
  in one upload at captured addresses (``perfkit/runtime/graph_inputs.py``), this is the graph's first launch.
- :func:`softcap_argmax` (``_softcap_argmax_kernel``), grid ``(R, P)``: each program turns BLOCK columns of the LM
  head's output into ``cap * tanh(z * (1 / cap))`` in fp32 (torch's order of operations: its ``div_`` by a scalar
  multiplies by the fp32 reciprocal) and stores them, then its largest value and that value's first column; the
  row's last program to finish (an atomic counter per row, as the tensor-core gemv's split-K sum) picks the largest
  of the P partial maxima, the first one on ties, so the id is ``logits.argmax(-1)`` of the stored logits exactly.
  The counters are back at zero after every launch, so a captured launch replays as is.

Measured (H200 12-20, ``configs/ab_decode_io.yaml``, ``docs/h200-runs/2026-12-20/2-*``, TPOT p50 separate -> fused,
2 repeats interleaved): 26B-A4B c1 2.753 -> 2.704 ms (-1.8 %), c4 5.277 -> 5.216; 31B c1 16.26 -> 16.22, c4 17.56 ->
17.51. In the profile (``4-p26.trace.json.xz``) the rows take 2.2 us and the soft-cap + argmax 15.5 us, ~9 us of it
under the LM head's tail (PDL). With the inputs in one upload too (``6-*``): 26B-A4B c1 2.769 -> 2.669 ms (-3.6 %),
31B c1 16.28 -> 16.17. Hence the toggle's default, fused.

Exactness: the rows are copies and one multiply rounded once, bit for bit the torch ops. The soft-cap's tanh is
libdevice's ``tanhf`` on the GPU (torch's CUDA ``tanh`` is the same function) and numpy's under the CPU interpreter.
NaN logits count as +inf for the argmax (torch's argmax also returns a NaN's column; it would pick a NaN after an
earlier +inf, this kernel the +inf).

Traffic (:func:`decode_rows_bytes`, :func:`softcap_argmax_bytes`): the rows read and write ``B * (H + 2 * sum(D_t))``
elements; the soft-cap reads the LM head's ``R * V`` output once and writes ``R * V`` fp32 logits once, where the
torch ops passed over them five times (copy, scale, tanh, scale, argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from perfkit.kernels.launch import interpreting
from perfkit.kernels.pdl import pdl_enter, pdl_launch

ROWS_BLOCK = 1024  # hidden columns per step of the embedding row's loop
ARGMAX_BLOCK = 2048  # vocabulary columns per soft-cap program (262144 -> 128 programs per row)

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _copy_row(src_ptr, dst_ptr, D, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(dst_ptr + d, tl.load(src_ptr + d, mask=d < D), mask=d < D)


@triton.jit
def _decode_rows_kernel(
    ids_ptr,  # [B] int64 token ids
    pos_ptr,  # [B] int64 positions
    src_ptr,  # [B] int64 (HAS_SRC): the row of prev's ids that is this row's token, or -1 (ids' own)
    prev_ptr,  # int64 the previous step's sampled ids (HAS_SRC)
    emb_ptr,  # [V, H] embedding table (unit column stride)
    h_ptr,  # [B, H] out: scaled embedding rows (unit column stride)
    ca_ptr, sa_ptr, ca_out, sa_out,  # table A: cos / sin [P, DA] contiguous -> [B, DA] contiguous
    cb_ptr, sb_ptr, cb_out, sb_out,  # table B (HAS_B): [P, DB] -> [B, DB]
    H, DA, DB, stride_emb, stride_h,
    scale,  # sqrt(H) rounded to the table's dtype (a float32 kernel argument, exact)
    pad_id, image_id, video_id, audio_id,
    HAS_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SRC: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    if j == 0:
        tok = tl.load(ids_ptr + b)
        if HAS_SRC:
            src = tl.load(src_ptr + b)
            tok = tl.where(src >= 0, tl.load(prev_ptr + tl.maximum(src, 0)), tok)
        placeholder = (tok == image_id) | (tok == video_id) | (tok == audio_id)
        tok = tl.where(placeholder, pad_id, tok).to(tl.int64)
        src = emb_ptr + tok * stride_emb
        dst = h_ptr + b.to(tl.int64) * stride_h
        for h0 in range(0, H, BLOCK_H):
            c = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(src + c, mask=c < H).to(tl.float32) * scale
            tl.store(dst + c, x.to(h_ptr.dtype.element_ty), mask=c < H)
    else:
        p = tl.load(pos_ptr + b).to(tl.int64)
        if j == 1:
            _copy_row(ca_ptr + p * DA, ca_out + b * DA, DA, BLOCK_D)
            _copy_row(sa_ptr + p * DA, sa_out + b * DA, DA, BLOCK_D)
        elif HAS_B:
            _copy_row(cb_ptr + p * DB, cb_out + b * DB, DB, BLOCK_D)
            _copy_row(sb_ptr + p * DB, sb_out + b * DB, DB, BLOCK_D)


@triton.jit
def _softcap_argmax_kernel(
    z_ptr,  # [R, V] LM head output (unit column stride)
    out_ptr,  # [R, V] fp32 out: soft-capped logits (unit column stride)
    val_ptr,  # [R, P] fp32 scratch: each program's largest value
    idx_ptr,  # [R, P] int32 scratch: its first column
    count_ptr,  # [R] int32: programs of the row done (zero between launches)
    ids_ptr,  # [R] int64 out: the row's argmax
    V, stride_z, stride_o,
    inv_cap,  # fp32(1 / cap), as torch's div_ by a scalar
    cap,
    HAS_CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= P, a power of two
    INTERP: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    num_p = tl.num_programs(1)
    c = p * BLOCK + tl.arange(0, BLOCK)
    m = c < V
    x = tl.load(z_ptr + r * stride_z + c, mask=m, other=0.0).to(tl.float32)
    if HAS_CAP:
        y = x * inv_cap
        if INTERP:
            t = (tl.exp(2.0 * y) - 1.0) / (tl.exp(2.0 * y) + 1.0)
            t = tl.where(y > 20.0, 1.0, tl.where(y < -20.0, -1.0, t))
        else:
            t = libdevice.tanh(y)
        x = t * cap
    tl.store(out_ptr + r * stride_o + c, x, mask=m)
    key = tl.where(x != x, float("inf"), x)  # NaN counts as the largest value
    key = tl.where(m, key, float("-inf"))
    v, i = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + r * num_p + p, v)
    tl.store(idx_ptr + r * num_p + p, p * BLOCK + i)
    tl.debug_barrier()  # the partial stored before the release half of the count
    if tl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="gpu") == num_p - 1:
        q = tl.arange(0, BLOCK_P)
        qm = q < num_p
        vals = tl.load(val_ptr + r * num_p + q, mask=qm, other=float("-inf"), cache_modifier=".cg")
        cols = tl.load(idx_ptr + r * num_p + q, mask=qm, other=0, cache_modifier=".cg")
        _, k = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(ids_ptr + r, tl.sum(tl.where(q == k, cols, 0), axis=0).to(tl.int64))
        tl.atomic_xchg(count_ptr + r, 0, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


def decode_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    emb: torch.Tensor,
    scale: float,
    token_ids: tuple[int, int, int, int],
    h_out: torch.Tensor,
    rope: list[tuple[torch.Tensor, torch.Tensor]],
    rope_out: list[tuple[torch.Tensor, torch.Tensor]],
    row_src: torch.Tensor | None = None,
    prev_ids: torch.Tensor | None = None,
    pdl: bool = False,
) -> None:
    """A decode step's model inputs in one launch.

    input_ids, positions: [B] int64 (device); emb: [V, H] embedding table; scale: the embedding multiplier (exact in
    the table's dtype); token_ids: (pad, image, video, audio) ids, the last three mapped to pad; h_out: [B, H] rows
    (unit column stride) = ``emb[id'] * scale``; rope: one or two RoPE tables (cos, sin) [P, D_t] contiguous, whose
    rows at ``positions`` go to rope_out's [B, D_t] contiguous tensors. row_src [B] int64 with prev_ids (int64):
    row b's token is ``prev_ids[row_src[b]]`` where row_src[b] >= 0 (a decode whose last token was sampled by the
    previous step, not yet on the host), else ``input_ids[b]``."""
    B, H = h_out.shape
    if not 1 <= len(rope) <= 2 or len(rope_out) != len(rope):
        raise ValueError(f"decode_rows takes one or two RoPE tables, got {len(rope)} and {len(rope_out)} outputs")
    if (row_src is None) != (prev_ids is None) or (row_src is not None and row_src.shape != (B,)):
        raise ValueError("decode_rows: row_src [B] and prev_ids go together")
    if input_ids.shape != (B,) or positions.shape != (B,) or emb.shape[1] != H or emb.stride(1) != 1:
        raise ValueError(f"decode_rows: ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}, table "
                         f"{tuple(emb.shape)} do not fit the rows {tuple(h_out.shape)}")  # fmt: skip
    for (c, s), (co, so) in zip(rope, rope_out, strict=True):
        for t in (c, s, co, so):
            if not t.is_contiguous() or t.shape[1] != c.shape[1]:
                raise ValueError("decode_rows: RoPE tables and their outputs must be contiguous and equally wide")
        if co.shape[0] != B or so.shape[0] != B:
            raise ValueError(f"decode_rows: RoPE outputs need {B} rows")
    if B == 0:
        return
    (ca, sa), (cao, sao) = rope[0], rope_out[0]
    (cb, sb), (cbo, sbo) = rope[-1], rope_out[-1]
    block_d = triton.next_power_of_2(max(ca.shape[1], cb.shape[1]))
    pad, image, video, audio = token_ids
    has_src = row_src is not None
    _decode_rows_kernel[(B, 1 + len(rope))](
        input_ids, positions, row_src if has_src else input_ids, prev_ids if has_src else input_ids, emb, h_out, ca,
        sa, cao, sao, cb, sb, cbo, sbo, H, ca.shape[1], cb.shape[1], emb.stride(0), h_out.stride(0), float(scale),
        pad, image, video, audio, HAS_B=len(rope) == 2, BLOCK_H=min(ROWS_BLOCK, triton.next_power_of_2(H)),
        BLOCK_D=block_d, HAS_SRC=has_src, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip


@dataclass
class GreedyIds:
    """The greedy ids of up to R rows and the scratch of their reduction (:func:`softcap_argmax`), allocated once:
    CUDA graphs capture these addresses, and every launch leaves ``count`` at zero for the next."""

    ids: torch.Tensor  # [R] int64
    values: torch.Tensor  # [R, P] fp32: each program's largest value
    columns: torch.Tensor  # [R, P] int32: its first column
    count: torch.Tensor  # [R] int32 zeros

    @classmethod
    def new(cls, rows: int, vocab: int, device: torch.device) -> GreedyIds:
        p = triton.cdiv(vocab, ARGMAX_BLOCK)
        return cls(
            ids=torch.zeros(rows, dtype=torch.int64, device=device),
            values=torch.empty(rows, p, dtype=torch.float32, device=device),
            columns=torch.empty(rows, p, dtype=torch.int32, device=device),
            count=torch.zeros(rows, dtype=torch.int32, device=device),
        )

    def head(self, rows: int) -> GreedyIds:
        """Views of the first `rows` rows (a captured batch size)."""
        return GreedyIds(self.ids[:rows], self.values[:rows], self.columns[:rows], self.count[:rows])


def softcap_argmax(z: torch.Tensor, cap: float, out: torch.Tensor, greedy: GreedyIds, pdl: bool = False) -> torch.Tensor:
    """z [R, V] (the LM head's output, any float dtype) -> out [R, V] fp32 = ``cap * tanh(z / cap)`` (z itself when
    cap is 0), torch's soft-cap in ``Gemma4ForCausalLM.logits``; greedy.ids[:R] = ``out.argmax(-1)`` (the first
    of equal maxima). Returns out."""
    R, V = z.shape
    P = triton.cdiv(V, ARGMAX_BLOCK)
    if out.shape != (R, V) or out.dtype != torch.float32 or z.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"softcap_argmax: out {tuple(out.shape)} {out.dtype} must be fp32 [{R}, {V}], unit column "
                         "strides")  # fmt: skip
    if greedy.ids.shape[0] < R or greedy.values.shape[1] != P or not greedy.values.is_contiguous():
        raise ValueError(f"softcap_argmax: greedy scratch for {greedy.ids.shape[0]} rows of "
                         f"{greedy.values.shape[1]} programs, need {R} of {P}")  # fmt: skip
    if R == 0:
        return out
    inv = float(np.float32(1.0) / np.float32(cap)) if cap else 0.0
    _softcap_argmax_kernel[(R, P)](
        z, out, greedy.values, greedy.columns, greedy.count, greedy.ids, V, z.stride(0), out.stride(0), inv,
        float(cap), HAS_CAP=bool(cap), BLOCK=ARGMAX_BLOCK, BLOCK_P=triton.next_power_of_2(P),
        INTERP=interpreting(), num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------------------
# PyTorch references and traffic
# --------------------------------------------------------------------------------------------------------------


def decode_rows_reference(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    emb: torch.Tensor,
    scale: float,
    token_ids: tuple[int, int, int, int],
    rope: list[tuple[torch.Tensor, torch.Tensor]],
    row_src: torch.Tensor | None = None,
    prev_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The torch ops the launch replaces (the runner's gather of sampled ids, `embed`, the RoPE lookup):
    (h [B, H], [(cos, sin) [B, D_t]])."""
    if row_src is not None:
        dst = (row_src >= 0).nonzero()[:, 0]
        input_ids = input_ids.clone().index_copy_(0, dst, prev_ids.index_select(0, row_src[dst]))
    pad, image, video, audio = token_ids
    ph = (input_ids == image) | (input_ids == video) | (input_ids == audio)
    h = torch.nn.functional.embedding(torch.where(ph, pad, input_ids), emb) * scale
    return h, [(c[positions], s[positions]) for c, s in rope]


def softcap_argmax_reference(z: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops the launch replaces: (fp32 logits [R, V], argmax ids [R] int64)."""
    logits = z.float()
    if cap:
        logits = logits.div(cap).tanh().mul(cap)
    return logits, logits.argmax(dim=-1)


def decode_rows_bytes(rows: int, hidden: int, rope_widths: list[int], itemsize: int) -> int:
    """DRAM bytes of one launch: per row, the embedding row read and written, each table's cos and sin row read and
    written, the id and the position read."""
    return rows * ((2 * hidden + 4 * sum(rope_widths)) * itemsize + 16)


def softcap_argmax_bytes(rows: int, vocab: int, z_itemsize: int) -> int:
    """DRAM bytes of one launch: the LM head's output read and the fp32 logits written once (the partial maxima and
    the ids are a few bytes per 2048 columns)."""
    return rows * vocab * (z_itemsize + 4) + rows * 8
