"""Gemma4 sliding-layer attention mask for context requests, in TRT-LLM's packed layout.

Layout: for each context request r, in batch order, a row-major bool matrix [Q_r, P_r + Q_r] (Q_r new tokens,
P_r cached prefix tokens); the matrices are flattened and concatenated, so request r starts at
``offset_r = sum_{s<r} Q_s (P_s + Q_s)``.

Rule (``reference/gemma4.md`` §4.4, sliding layers of the "vision" bidirectional models), in absolute
positions a (query, ``a = P_r + i``) and b (key, ``b = column``)::

    allow(a, b) = (a - b < W) and (b <= a or same_blob(a, b))

A blob is a maximal run of consecutive *new* tokens of one vision type (1 image or 2 video; a type change starts
a new blob). Text (0) and audio (3) tokens are never bidirectional. ``W = None`` means no window.

Decision on the cached-prefix columns and on windows shorter than a blob (documented here because
TRT-LLM differs): both ``impl`` values follow the rule above literally. Prefix columns are *not* all True as in
TRT-LLM (which leaves the window to the attention kernel's ``window_left``); they carry the window in
absolute positions (a prefix token is never in a blob of the new tokens, so there only ``a - b < W`` matters).
The window is applied after OR-ing the blob, so inside a blob longer than W keys older than ``a - W + 1`` are
masked (vLLM #47217 behaviour), unlike TRT-LLM's dense code which windows before the OR.

A consequence used by the kernel: every row's allowed set is one contiguous column interval::

    lo(a) = max(0, a - W + 1)        hi(a) = P + blob_end(i) if token i is in a blob else a + 1

(``blob_end`` exclusive, request-local; inside a blob ``blob_start <= i`` so ``[lo, a] ∪ ([blob) ∩ [lo, ∞))``
is ``[lo, blob_end)``). So the only per-token metadata is one int32 "row end" (O(N)).

Two implementations (the A/B arms of the ``mask`` toggle):

- ``dense`` (A, :func:`gemma_mask_ref`): the old construction with its quadratic intermediates (§5.2): causal
  [Q,Q], blob-equality [Q,Q], out-of-place ``masked_fill``, window temporaries, ``ones`` + ``cat`` for the prefix,
  a per-request list and a final ``torch.cat``. Peak memory (bytes of bool, see :func:`gemma_mask_peak_bytes`):
  ``max_r(sum_{s<r} Q_s L_s + 3 Q_r^2 + 2 Q_r P_r, 2 sum_s Q_s L_s)`` with ``L = P + Q``.
- ``triton`` (B, :func:`gemma_mask`): a tiny O(N) kernel writes the row ends, then a 2-D tiled kernel writes the
  packed output directly. Peak memory = output + 4 N B (row ends) + 48 R B (plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

VISION_TYPES = (1, 2)  # image, video; 0 text, 3 audio are causal
_BIG = 2**31 - 1

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _find_request(starts_ptr, pid, R, n_search):
    """Largest r in [0, R) with starts[r] <= pid (starts is a non-decreasing prefix sum, starts[0] = 0)."""
    lo = pid * 0
    hi = pid * 0 + R
    for _ in range(n_search):
        mid = (lo + hi) // 2
        go_right = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _end_candidates(types_ptr, tok_start, t, q_len):
    """For request-local token indices t: (is_vision, t + 1 where a vision run ends at t else BIG)."""
    in_req = t < q_len
    ty = tl.load(types_ptr + tok_start + t, mask=in_req, other=0)
    nxt = tl.load(types_ptr + tok_start + t + 1, mask=(t + 1) < q_len, other=-1)
    is_vis = ((ty == 1) | (ty == 2)) & in_req
    run_ends = is_vis & (nxt != ty)
    return is_vis, tl.where(run_ends, t + 1, 2147483647)


@triton.jit
def _gemma_row_end_kernel(
    types_ptr,  # [N] int, token types of the new tokens of all context requests, concatenated
    row_end_ptr,  # [N] int32 out: request-local exclusive end of each row's allowed new-token columns
    plan_ptr,  # int64 [6R + 2], see GemmaMaskPlan
    R,
    n_search,
    BLOCK_T: tl.constexpr,
):
    """row_end[i] = blob_end(i) for vision tokens, i + 1 otherwise (O(N), one program per BLOCK_T tokens)."""
    pid = tl.program_id(0)
    r = _find_request(plan_ptr + 5 * R + 1, pid, R, n_search)
    tok_start = tl.load(plan_ptr + r)
    q_len = tl.load(plan_ptr + R + r).to(tl.int32)
    b0 = (pid - tl.load(plan_ptr + 5 * R + 1 + r)).to(tl.int32) * BLOCK_T
    t = b0 + tl.arange(0, BLOCK_T)
    is_vis, cand = _end_candidates(types_ptr, tok_start, t, q_len)
    run_end = tl.associative_scan(cand, 0, _min_combine, reverse=True)
    # The last run of the block may continue into the next blocks: scan forward until it ends (it ends at the
    # latest at the request's last token, whose candidate is always set when it is a vision token).
    open_run = tl.max(tl.where(is_vis & (run_end == 2147483647), 1, 0), axis=0)
    carry = tl.where(open_run > 0, 2147483647, 0)
    pos = b0 + BLOCK_T
    while carry == 2147483647:
        _, c2 = _end_candidates(types_ptr, tok_start, pos + tl.arange(0, BLOCK_T), q_len)
        carry = tl.min(c2, axis=0)
        pos += BLOCK_T
    run_end = tl.where(run_end == 2147483647, carry, run_end)
    row_end = tl.where(is_vis, run_end, t + 1)
    tl.store(row_end_ptr + tok_start + t, row_end, mask=t < q_len)


@triton.jit
def _gemma_mask_kernel(
    out_ptr,  # uint8 view of the flat bool output (16-byte aligned allocation)
    row_end_ptr,  # [N] int32 from _gemma_row_end_kernel
    plan_ptr,  # int64 [6R + 2]
    R,
    n_search,
    window,  # int32; > every row length means "no window"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program writes a BLOCK_M x BLOCK_N tile of one request's [Q, P+Q] matrix.

    grid = (row tiles summed over requests, column tiles of the widest request + 1 when rows are unaligned).
    Row i's allowed columns are the interval [lo_i, hi_i). Each row's tile starts at a 16-byte aligned address
    (columns c0 - shift_i + k, shift_i = row start mod 16) so interior tiles are unmasked 16-byte stores; tiles
    fully inside every row's interval, or fully outside, store constants.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = _find_request(plan_ptr + 4 * R, pid_m, R, n_search)
    tok_start = tl.load(plan_ptr + r)
    q_len = tl.load(plan_ptr + R + r).to(tl.int32)
    p_len = tl.load(plan_ptr + 2 * R + r).to(tl.int32)
    out_off = tl.load(plan_ptr + 3 * R + r)
    row_len = p_len + q_len
    c0 = pid_n * BLOCK_N
    if c0 < row_len + 15:
        i0 = (pid_m - tl.load(plan_ptr + 4 * R + r)).to(tl.int32) * BLOCK_M
        rows = i0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        hi = p_len + tl.load(row_end_ptr + tok_start + rows, mask=row_ok, other=0)
        lo = tl.maximum(p_len + rows - window + 1, 0)
        row_base = out_off + rows.to(tl.int64) * row_len
        shift = (row_base & 15).to(tl.int32)
        k = tl.arange(0, BLOCK_N)
        ptrs = out_ptr + (tl.multiple_of(row_base - shift, 16)[:, None] + (c0 + k)[None, :])
        k_lo = (lo - c0 + shift)[:, None]  # element (i, k) is column c0 - shift_i + k
        k_hi = (hi - c0 + shift)[:, None]
        c_min = c0 - tl.max(shift, axis=0)  # smallest / largest column any row of the tile touches
        c_max = c0 - tl.min(shift, axis=0) + BLOCK_N - 1
        if (i0 + BLOCK_M <= q_len) & (c_min >= 0) & (c_max < row_len):
            # lo is non-decreasing in the row; hi is not (blob rows reach past the diagonal).
            lo_first = tl.maximum(p_len + i0 - window + 1, 0)
            lo_last = tl.maximum(p_len + i0 + BLOCK_M - window, 0)
            if (lo_last <= c_min) & (tl.min(hi, axis=0) > c_max):
                tl.store(ptrs, tl.full([BLOCK_M, BLOCK_N], 1, tl.uint8))
            elif (lo_first > c_max) | (tl.max(hi, axis=0) <= c_min):
                tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_N], tl.uint8))
            else:
                v = (k[None, :] >= k_lo) & (k[None, :] < k_hi)
                tl.store(ptrs, v.to(tl.uint8))
        else:
            cols = k[None, :] + (c0 - shift)[:, None]
            v = (k[None, :] >= k_lo) & (k[None, :] < k_hi)
            tl.store(ptrs, v.to(tl.uint8), mask=row_ok[:, None] & (cols >= 0) & (cols < row_len))


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------


def _as_int_list(x: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    vals = x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]
    if any(v < 0 for v in vals):
        raise ValueError(f"{name} must be >= 0, got {vals}")
    return vals


@dataclass(frozen=True)
class GemmaMaskPlan:
    """Host-side per-request layout (python ints) and its packed int64 device form.

    ``packed`` = [tok_start(R) | q_len(R) | p_len(R) | out_off(R) | row_tile_start(R+1) | tok_block_start(R+1)].
    """

    q_lens: list[int]
    p_lens: list[int]
    tok_starts: list[int]
    out_offs: list[int]
    total: int
    n_row_tiles: int
    n_tok_blocks: int
    max_row_len: int
    packed: list[int]


def make_plan(q_lens: list[int], p_lens: list[int], block_m: int, block_t: int) -> GemmaMaskPlan:
    tok_starts, out_offs, row_tiles, tok_blocks = [], [], [0], [0]
    tok = off = 0
    for q, p in zip(q_lens, p_lens, strict=True):
        tok_starts.append(tok)
        out_offs.append(off)
        tok += q
        off += q * (p + q)
        row_tiles.append(row_tiles[-1] + triton.cdiv(q, block_m))
        tok_blocks.append(tok_blocks[-1] + triton.cdiv(q, block_t))
    max_row_len = max((p + q for q, p in zip(q_lens, p_lens, strict=True) if q > 0), default=0)
    packed = tok_starts + q_lens + p_lens + out_offs + row_tiles + tok_blocks
    return GemmaMaskPlan(q_lens, p_lens, tok_starts, out_offs, off, row_tiles[-1], tok_blocks[-1], max_row_len, packed)


def _check_inputs(token_type_ids: torch.Tensor, seq_lens, prefix_lens) -> tuple[list[int], list[int]]:
    q_lens = _as_int_list(seq_lens, "seq_lens")
    p_lens = _as_int_list(prefix_lens, "prefix_lens")
    if len(q_lens) != len(p_lens):
        raise ValueError(f"seq_lens has {len(q_lens)} requests, prefix_lens {len(p_lens)}")
    if token_type_ids.dim() != 1 or token_type_ids.numel() != sum(q_lens):
        raise ValueError(
            f"token_type_ids must be flat with sum(seq_lens)={sum(q_lens)} entries, "
            f"got shape {tuple(token_type_ids.shape)}"
        )
    if token_type_ids.dtype.is_floating_point or token_type_ids.dtype == torch.bool:
        raise ValueError(f"token_type_ids must be an integer tensor, got {token_type_ids.dtype}")
    return q_lens, p_lens


def gemma_mask(
    token_type_ids: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    prefix_lens: Sequence[int] | torch.Tensor,
    sliding_window: int | None,
    *,
    block_m: int = 16,
    block_n: int = 512,
    block_t: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton path (B): packed flat bool mask, written tile by tile; peak = output + 4N + 48R bytes.

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set by the caller before triton is
    imported; never here).
    """
    q_lens, p_lens = _check_inputs(token_type_ids, seq_lens, prefix_lens)
    device = token_type_ids.device
    plan = make_plan(q_lens, p_lens, block_m, block_t)
    out = torch.empty(plan.total, dtype=torch.bool, device=device)
    if plan.total == 0:
        return out
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    window = plan.max_row_len + 1 if sliding_window is None else min(int(sliding_window), plan.max_row_len + 1)
    if plan.max_row_len + block_n >= 2**31:
        raise ValueError(f"a row of {plan.max_row_len} columns does not fit the kernel's int32 column index")
    types = token_type_ids if token_type_ids.is_contiguous() else token_type_ids.contiguous()
    packed = torch.tensor(plan.packed, dtype=torch.int64)
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    row_end = torch.empty(types.numel(), dtype=torch.int32, device=device)
    n_req = len(q_lens)
    n_search = max(1, n_req.bit_length())
    _gemma_row_end_kernel[(plan.n_tok_blocks,)](types, row_end, packed, n_req, n_search, BLOCK_T=block_t)
    aligned = all((p + q) % 16 == 0 for q, p in zip(q_lens, p_lens, strict=True))
    grid = (plan.n_row_tiles, triton.cdiv(plan.max_row_len + (0 if aligned else 15), block_n))
    _gemma_mask_kernel[grid](
        out.view(torch.uint8),
        row_end,
        packed,
        n_req,
        n_search,
        window,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out


# --------------------------------------------------------------------------------------------------------------
# PyTorch reference = the dense A path
# --------------------------------------------------------------------------------------------------------------


def _blob_ids(types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRT-style blob ids: cumsum of run starts over vision tokens (a type change starts a run); -1 elsewhere."""
    ty = types.to(torch.int64)  # clone (the old code clones the ids)
    is_vision = (ty == 1) | (ty == 2)
    padded = torch.cat([torch.full_like(ty[:1], -1), ty])
    changes = padded[1:] != padded[:-1]
    starts = is_vision & changes
    ids = torch.cumsum(starts.to(torch.int64), 0) - 1
    return torch.where(is_vision, ids, torch.full_like(ids, -1)), is_vision


def _dense_one(types: torch.Tensor, q: int, p: int, window: int | None) -> torch.Tensor:
    dev = types.device
    pos = torch.arange(q, device=dev)
    causal = pos[None, :] <= pos[:, None]  # [Q, Q]
    blob, is_vision = _blob_ids(types)
    same_blob = blob[:, None] == blob[None, :]  # [Q, Q]
    same_blob &= is_vision[:, None]
    same_blob &= is_vision[None, :]
    mask = causal.masked_fill(same_blob, True)  # out of place: a third [Q, Q]
    del same_blob
    if window is not None and window < q:  # window after the blob OR (the rule), transient [Q, Q]
        in_window = pos[None, :] > (pos - window)[:, None]
        mask &= in_window
        del in_window
    if p > 0:
        prefix = torch.ones(q, p, dtype=torch.bool, device=dev)  # [Q, P]
        if window is not None and window <= p + q - 1:  # absolute positions: query p + i, key b < p
            kpos = torch.arange(p, device=dev)
            in_window = kpos[None, :] > (pos + p - window)[:, None]  # transient [Q, P]
            prefix &= in_window
            del in_window
        mask = torch.cat([prefix, mask], dim=1)  # [Q, P + Q] while causal, the old mask and prefix live
    return mask.flatten()


def gemma_mask_ref(
    token_type_ids: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    prefix_lens: Sequence[int] | torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """Dense path (A): the old per-request construction with quadratic intermediates, then one final cat."""
    q_lens, p_lens = _check_inputs(token_type_ids, seq_lens, prefix_lens)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    flats, start = [], 0
    for q, p in zip(q_lens, p_lens, strict=True):
        if q > 0:
            flats.append(_dense_one(token_type_ids[start : start + q], q, p, sliding_window))
        start += q
    if not flats:
        return torch.empty(0, dtype=torch.bool, device=token_type_ids.device)
    return torch.cat(flats)


def build_gemma_attention_mask(
    token_type_ids: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    prefix_lens: Sequence[int] | torch.Tensor,
    sliding_window: int | None,
    impl: str = "triton",
) -> torch.Tensor:
    """Packed sliding-layer mask of the context requests (see the module docstring); ``impl`` = triton | dense."""
    if impl == "triton":
        return gemma_mask(token_type_ids, seq_lens, prefix_lens, sliding_window)
    if impl == "dense":
        return gemma_mask_ref(token_type_ids, seq_lens, prefix_lens, sliding_window)
    raise ValueError(f"impl {impl!r}: allowed values are triton, dense")


# --------------------------------------------------------------------------------------------------------------
# Traffic and memory formulas
# --------------------------------------------------------------------------------------------------------------


def gemma_mask_traffic(seq_lens: Sequence[int], prefix_lens: Sequence[int], type_id_bytes: int = 8) -> dict[str, int]:
    """Minimum DRAM bytes of the Triton path (B).

    Written: the output, sum Q(P+Q) (1 B per bool), plus 4 B of row end per token. Read: the type ids, the row
    ends once (re-reads per column tile hit L2) and the (6R + 2) x 8 B plan. The output dominates; the latency
    bound used by the sweep is ``output_bytes / write bandwidth``.
    """
    q_lens = [int(q) for q in seq_lens]
    p_lens = [int(p) for p in prefix_lens]
    n, r = sum(q_lens), len(q_lens)
    output = sum(q * (p + q) for q, p in zip(q_lens, p_lens, strict=True))
    plan = 8 * (6 * r + 2)
    read = n * type_id_bytes + 4 * n + plan
    written = output + 4 * n
    return {"output_bytes": output, "bytes_written": written, "bytes_read": read, "total_bytes": written + read}


def gemma_mask_peak_bytes(
    seq_lens: Sequence[int], prefix_lens: Sequence[int], sliding_window: int | None, impl: str
) -> int:
    """Predicted peak of live allocations during one call, output included.

    dense: ``max(max_r(sum_{s<r} Q_s L_s + 3 Q_r^2 + 2 Q_r P_r), 2 sum_s Q_s L_s)`` (``L = P + Q``; quadratic
    terms only, the O(Q) int64 temporaries, ~17 B per token alive at the peak, are left out); triton: output +
    4N + plan, exact. ``sliding_window`` changes neither (its temporaries are never part of the largest live set).
    """
    q_lens = [int(q) for q in seq_lens]
    p_lens = [int(p) for p in prefix_lens]
    total = sum(q * (p + q) for q, p in zip(q_lens, p_lens, strict=True))
    if impl == "triton":
        return total + 4 * sum(q_lens) + 8 * (6 * len(q_lens) + 2)
    if impl != "dense":
        raise ValueError(f"impl {impl!r}: allowed values are triton, dense")
    acc = peak = 0
    for q, p in zip(q_lens, p_lens, strict=True):
        if q == 0:
            continue
        peak = max(peak, acc + 3 * q * q + 2 * q * p)
        acc += q * (p + q)
    return max(peak, 2 * total)
