"""Per-step attention metadata and the two page-table builders (`page_table=host|padded`).

Both builders turn the block manager's live page lists into FlashInfer's CSR page table per pool:
`indptr [B+1]` (CPU int32), `indices [nnz]` (DEVICE int32, a slice of a persistent buffer), `last_page_len [B]`
(CPU int32), plus the live kv lengths (CPU) and the slot of every new token (DEVICE page + in-page offset).
They must produce byte-identical indptr / indices / last_page_len (tests/test_engine_page_table.py).

* `padded` (the old syncing path, TensorRT-LLM pre-#15848): block lists padded to a `[B, max_blocks]` device
  tensor; kv lengths and block counts computed ON THE DEVICE and read back with `.tolist()` (a sync); a Python
  loop flattens the lists; pageable H2D copies; last_page_len / kv_lens read back from the device (more syncs).
* `host` (#16073 style): counts from host bookkeeping with numpy, the flat live-page list written straight into
  persistent pinned staging (pinned only when CUDA is available) and sent with one async H2D copy into a
  persistent device buffer. Staging buffers are double-buffered and each has a CUDA event recorded after its
  copy; a buffer is rewritten only after its event completed, so the host may run ahead safely.

Trimmed sliding pages: `first` live logical page per request; kv length seen by the kernel is
`(start + q) - first * page_size`; last_page_len is unchanged by trimming (whole pages are dropped).
Graph padding: `pad_to` appends dummy requests (one query token, kv length 1, the reserved dummy page).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from perfkit.runtime.block_manager import BlockManager
from perfkit.runtime.kv_cache import DUMMY_PAGE


@dataclass
class PoolTable:
    """CSR page table of one pool for one step (B rows, including graph-padding dummies)."""

    indptr: torch.Tensor  # CPU int32 [B+1]
    indices: torch.Tensor  # DEVICE int32 [nnz]
    last_page_len: torch.Tensor  # CPU int32 [B]
    kv_lens: torch.Tensor  # CPU int32 [B]: live kv length seen by attention
    slot_page: torch.Tensor  # DEVICE int64 [T]: page of each new token
    slot_offset: torch.Tensor  # DEVICE int64 [T]: offset inside that page
    # device copies of indptr / kv_lens uploaded with the step's other inputs (decode graphs' one upload,
    # perfkit/runtime/graph_inputs.py): the Triton decode reads them instead of uploading its own
    indptr_dev: torch.Tensor | None = None  # DEVICE int32 [B+1]
    kv_lens_dev: torch.Tensor | None = None  # DEVICE int32 [B]


@dataclass
class HostPoolArrays:
    """One pool's page table for one step on the host (numpy), before any upload: what `PoolTable` holds."""

    indptr: np.ndarray  # int64 [B+1]
    indices: np.ndarray  # int32 [nnz]
    last_page_len: np.ndarray  # int64 [B]
    kv_lens: np.ndarray  # int64 [B]
    slot_page: np.ndarray  # int64 [T]
    slot_offset: np.ndarray  # int64 [T]

    def cpu_fields(self) -> dict[str, torch.Tensor]:
        """The fields a `PoolTable` keeps on the host, as CPU int32 tensors (FlashInfer's plan reads them there)."""
        return {n: torch.from_numpy(getattr(self, n).astype(np.int32)) for n in ("indptr", "last_page_len", "kv_lens")}


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; passed to the backend explicitly (never a global).

    Token order: the `num_decodes` decode requests (one token each) come first, then prefill chunks.
    """

    num_tokens: int
    num_decodes: int
    qo_indptr: torch.Tensor  # CPU int32 [B+1]
    pools: dict[str, PoolTable]
    # Sliding-layer custom mask of bidirectional models when prefill chunks hold vision tokens: flat bool
    # (device), concatenation over prefill requests of [q_r, kv_live_r] row-major (sliding-pool kv lengths).
    custom_mask: torch.Tensor | None = None
    graph_batch_size: int | None = None  # set when the step replays a captured decode graph

    @classmethod
    def graph_decode(cls, bs: int, pools: dict[str, PoolTable]) -> AttentionMetadata:
        """A decode-only step of `bs` rows (graph padding included) replayed from the decode graph of that size."""
        return cls(num_tokens=bs, num_decodes=bs, qo_indptr=torch.arange(bs + 1, dtype=torch.int32), pools=pools,
                   graph_batch_size=bs)  # fmt: skip

    @property
    def batch_size(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


@dataclass
class BatchState:
    """What the builders need from the scheduler: per request id, first position and new-token count."""

    req_ids: list[int]
    starts: np.ndarray  # int64 [B]: num_computed before the step
    q_lens: np.ndarray  # int64 [B]

    @property
    def kv_ends(self) -> np.ndarray:
        return self.starts + self.q_lens


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


class PinnedStaging:
    """Double-buffered (pinned when CUDA exists) host staging + one persistent device buffer.

    `upload(arr)` writes `arr` into the next staging buffer (after waiting for the event of the copy that last
    read it), issues one non-blocking H2D copy and records an event. Returns a view of the device buffer.
    `upload_parts(parts)` does the same for several arrays at once, each starting on a 16-byte boundary.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.device = device
        self.host = [_pin(torch.zeros(size, dtype=dtype)) for _ in range(2)]
        self.dev = torch.zeros(size, dtype=dtype, device=device)
        cuda = device.type == "cuda"
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.recorded = [False, False]
        self.k = 0

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        n = len(arr)
        if n > self.dev.numel():  # grow (rare: an oversized vision blob); old copies must finish first
            for ev, rec in zip(self.events, self.recorded, strict=True):
                if ev is not None and rec:
                    ev.synchronize()
            self.__init__(2 * n, self.dev.dtype, self.device)
        k = self.k
        self.k ^= 1
        ev = self.events[k]
        if ev is not None and self.recorded[k] and not ev.query():
            ev.synchronize()  # the copy that last read host[k] has not run yet: wait before rewriting it
        self.host[k].numpy()[:n] = arr
        out = self.dev[:n]
        out.copy_(self.host[k][:n], non_blocking=True)
        if self.events[k] is not None:
            self.events[k].record()
            self.recorded[k] = True
        return out

    def upload_parts(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Several arrays in one upload, one device view each, every view starting on a 16-byte boundary (up to
        16 / itemsize - 1 elements of padding before each part after the first). Why aligned: Triton specialises a
        pointer argument on 16-byte alignment, so a part whose alignment followed the lengths before it would give
        eager steps and graph captures different kernel variants, compiled inside a measured window (H200 12-04
        call 2: the fused qkv kernel's slot offsets, 2-4 compiles of up to 0.93 s at c16; the Triton decode's kv
        lengths, 0.37 s at c32)."""
        step = max(1, 16 // self.dev.element_size())
        offsets, n = [], 0
        for part in parts:
            n = -(-n // step) * step
            offsets.append(n)
            n += len(part)
        staged = np.zeros(n, dtype=self.host[0].numpy().dtype)
        for part, off in zip(parts, offsets, strict=True):
            staged[off : off + len(part)] = part
        dev = self.upload(staged)
        return [dev[off : off + len(part)] for part, off in zip(parts, offsets, strict=True)]


def _with_dummies(state: BatchState, pad_to: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    n_pad = 0 if pad_to is None else pad_to - len(state.req_ids)
    if n_pad < 0:
        raise ValueError(f"batch {len(state.req_ids)} larger than pad_to {pad_to}")
    starts = np.concatenate([state.starts, np.zeros(n_pad, np.int64)])
    q_lens = np.concatenate([state.q_lens, np.ones(n_pad, np.int64)])
    return starts, q_lens, n_pad


class HostPageTableBuilder:
    """`page_table=host`: numpy on the host, pinned staging, one async H2D copy per pool, zero syncs."""

    def __init__(self, bm: BlockManager, device, max_tokens: int, max_batch_size: int):
        self.bm = bm
        self.ps = bm.page_size
        self.device = torch.device(device)
        self.idx_stage = {
            p: PinnedStaging(n + max_batch_size, torch.int32, self.device) for p, n in bm.capacity.items()
        }
        # + 1 for the slot offsets' 16-byte start (upload_parts)
        self.slot_stage = {p: PinnedStaging(2 * max_tokens + 1, torch.int64, self.device) for p in bm.capacity}

    def build(self, state: BatchState, pad_to: int | None = None) -> dict[str, PoolTable]:
        out: dict[str, PoolTable] = {}
        for pool, a in host_pool_arrays(self.bm, state, pad_to).items():
            slot_page_d, slot_offset_d = self.slot_stage[pool].upload_parts([a.slot_page, a.slot_offset])
            out[pool] = PoolTable(
                **a.cpu_fields(), indices=self.idx_stage[pool].upload(a.indices), slot_page=slot_page_d,
                slot_offset=slot_offset_d,
            )  # fmt: skip
        return out


def host_pool_arrays(bm: BlockManager, state: BatchState, pad_to: int | None = None) -> dict[str, HostPoolArrays]:
    """Every pool's page table of a step from the block manager's page lists, with numpy on the host (`host`
    builder; the decode graphs' one upload, perfkit/runtime/graph_inputs.py)."""
    ps = bm.page_size
    starts, q_lens, n_pad = _with_dummies(state, pad_to)
    kv_ends = starts + q_lens
    b = len(starts)
    # token-level request index and position
    req_of_tok = np.repeat(np.arange(b), q_lens)
    tok_off = np.arange(len(req_of_tok)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    pos = starts[req_of_tok] + tok_off
    out: dict[str, HostPoolArrays] = {}
    for pool in bm.pools:
        lists = [bm.page_list(r, pool) for r in state.req_ids]
        firsts = np.fromiter((pl.first for pl in lists), np.int64, len(lists))
        counts = np.fromiter((len(pl.pages) for pl in lists), np.int64, len(lists))
        firsts = np.concatenate([firsts, np.zeros(n_pad, np.int64)])
        counts = np.concatenate([counts, np.ones(n_pad, np.int64)])
        kv_lens = kv_ends - firsts * ps
        indptr = np.zeros(b + 1, np.int64)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        flat = np.fromiter(chain(chain.from_iterable(pl.pages for pl in lists), [DUMMY_PAGE] * n_pad), np.int32, nnz)
        slot_page = flat[indptr[req_of_tok] + pos // ps - firsts[req_of_tok]].astype(np.int64)
        out[pool] = HostPoolArrays(indptr=indptr, indices=flat, last_page_len=kv_lens - (counts - 1) * ps,
                                   kv_lens=kv_lens, slot_page=slot_page, slot_offset=pos % ps)  # fmt: skip
    return out


class PaddedPageTableBuilder:
    """`page_table=padded`: the old path. Padded [B, max_blocks] device table, counts computed on the device and
    read back with `.tolist()`, Python flattening loop, pageable H2D copies. Same outputs as the host builder."""

    def __init__(self, bm: BlockManager, device, max_tokens: int, max_batch_size: int):
        self.bm = bm
        self.ps = bm.page_size
        self.device = torch.device(device)
        self.idx_buf = {p: torch.zeros(n + max_batch_size, dtype=torch.int32, device=self.device)
                        for p, n in bm.capacity.items()}  # fmt: skip

    def build(self, state: BatchState, pad_to: int | None = None) -> dict[str, PoolTable]:
        ps, dev = self.ps, self.device
        starts, q_lens, n_pad = _with_dummies(state, pad_to)
        starts_d = torch.tensor(starts, device=dev)
        q_d = torch.tensor(q_lens, device=dev)
        kv_end_d = starts_d + q_d
        req_of_tok_d = torch.repeat_interleave(torch.arange(len(starts), device=dev), q_d)
        pos_d = torch.cat([torch.arange(int(s), int(s + q), device=dev) for s, q in zip(starts, q_lens, strict=True)])
        out: dict[str, PoolTable] = {}
        for pool in self.bm.pools:
            lists = [self.bm.page_list(r, pool) for r in state.req_ids]
            rows = [list(pl.pages) for pl in lists] + [[DUMMY_PAGE]] * n_pad
            firsts = [pl.first for pl in lists] + [0] * n_pad
            max_blocks = max(len(r) for r in rows)
            table_d = torch.tensor([r + [0] * (max_blocks - len(r)) for r in rows], dtype=torch.int32, device=dev)
            first_d = torch.tensor(firsts, device=dev)
            kv_lens_d = kv_end_d - first_d * ps
            num_blocks_d = (kv_lens_d + ps - 1) // ps
            num_blocks = num_blocks_d.tolist()  # device -> host sync
            last_d = kv_lens_d - (num_blocks_d - 1) * ps
            flat: list[int] = []
            indptr = [0]
            for row, nb in zip(rows, num_blocks, strict=True):
                flat.extend(row[:nb])
                indptr.append(indptr[-1] + nb)
            indices = self.idx_buf[pool][: len(flat)]
            indices.copy_(torch.tensor(flat, dtype=torch.int32), non_blocking=True)
            local_d = pos_d // ps - first_d[req_of_tok_d]
            out[pool] = PoolTable(
                indptr=torch.tensor(indptr, dtype=torch.int32),
                indices=indices,
                last_page_len=last_d.to(torch.int32).cpu(),  # sync
                kv_lens=kv_lens_d.to(torch.int32).cpu(),  # sync
                slot_page=table_d[req_of_tok_d, local_d].long(),
                slot_offset=pos_d % ps,
            )
        return out


def make_page_table_builder(kind: str, bm: BlockManager, device, max_tokens: int, max_batch_size: int):
    if kind == "host":
        return HostPageTableBuilder(bm, device, max_tokens, max_batch_size)
    if kind == "padded":
        return PaddedPageTableBuilder(bm, device, max_tokens, max_batch_size)
    raise ValueError(f"page_table must be host|padded, got {kind!r}")
