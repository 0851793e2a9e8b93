"""A decode-graph step's host inputs in one pinned buffer and one H2D copy, at addresses the graph captured.

Why: before each replay the runner sent the token inputs, each pool's new-token slots and page ids, and the Triton
decode's lengths as separate uploads, then copied the slots and page ids into the graph's static buffers: 26B-A4B
batch 1 ran five H2D copies, two launches gathering the previous step's ids, four slot copies and two metadata
uploads with their copies around every 2.7 ms replay (H200 12-20, ``docs/h200-runs/2026-12-20/4-p26.trace.json.xz``),
each 1-4 us of a device that waits for them. Here every one of them is a region of one byte buffer whose layout is
fixed per captured batch size, written on the host and sent with one copy; the captured kernels read the regions in
place, and the graph's first launch (``decode_io.decode_rows``) takes each row's token from the previous step's
sampled ids itself (``row_src``).

Layout for a captured size B (every region starts on 16 bytes, so Triton's pointer alignment never changes):
``ids [B] int64 | positions [B] int64 | row_src [B] int64`` then per pool ``slot_page [B] int64 | slot_offset [B]
int64 | indptr [B+1] int32 | kv_lens [B] int32``, then per pool its page ids ``indices [B * max_pages_per_row]
int32``, the pool with the most pages per row last. A step copies the bytes up to the end of the last pool's used
page ids: the earlier pools' unused page slots travel too (26B-A4B / 31B: the sliding pool's 578 per row, 2.3 KB).

Used by ``DecodeGraphs`` under toggle decode_io=fused with the host page-table builder, where the model's inputs
are one launch (``Gemma4ForCausalLM.decode_rows_apply``). Measured with the rest of decode_io (H200 12-20,
``docs/h200-runs/2026-12-20/6-*``): 26B-A4B c1 TPOT 2.769 -> 2.669 ms (call 2, with decode_io's launches alone and
the separate uploads: 2.753 -> 2.704 ms); the step is 367 device operations (12-19: 403).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from perfkit.runtime.page_table import HostPoolArrays, PinnedStaging, PoolTable

_ALIGN = 16  # bytes


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Region:
    offset: int  # bytes
    count: int  # elements (capacity)
    dtype: np.dtype

    @property
    def end(self) -> int:
        return self.offset + self.count * self.dtype.itemsize


@dataclass
class GraphStepViews:
    """Device views of one step's inputs (the same addresses at capture and at every replay of a size)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    row_src: torch.Tensor  # [B] int64: the row of the previous step's sampled ids this row's token is, or -1
    pools: dict[str, PoolTable]


class GraphStepInputs:
    """Fixed per-size layouts over one device buffer, filled by one pinned upload per step (module docstring)."""

    def __init__(self, sizes: list[int], max_pages_per_row: dict[str, int], device: torch.device):
        self.pools = sorted(max_pages_per_row, key=lambda p: max_pages_per_row[p])  # the largest region last: a
        # step copies up to the end of the last pool's used page ids, so only the smaller regions' slack travels
        self.layouts = {bs: self._layout(bs, max_pages_per_row) for bs in sizes}
        size = max(max(r.end for r in lay.values()) for lay in self.layouts.values())
        self.stage = PinnedStaging(size, torch.uint8, device)
        self.views = {bs: self._views(bs) for bs in sizes}

    def _layout(self, bs: int, max_pages: dict[str, int]) -> dict[tuple[str, str], _Region]:
        i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
        parts: list[tuple[tuple[str, str], int, np.dtype]] = [(("", n), bs, i64) for n in ("ids", "pos", "src")]
        for p in self.pools:
            parts += [((p, "slot_page"), bs, i64), ((p, "slot_offset"), bs, i64), ((p, "indptr"), bs + 1, i32),
                      ((p, "kv_lens"), bs, i32)]  # fmt: skip
        parts += [((p, "indices"), bs * max_pages[p], i32) for p in self.pools]
        out, off = {}, 0
        for key, n, dt in parts:
            out[key] = _Region(off, n, dt)
            off = _up(off + n * dt.itemsize)
        return out

    def _views(self, bs: int) -> GraphStepViews:
        dev = self.stage.dev
        lay = self.layouts[bs]

        def view(key: tuple[str, str]) -> torch.Tensor:
            r = lay[key]
            return dev[r.offset : r.end].view(torch.int64 if r.dtype.itemsize == 8 else torch.int32)

        pools = {}
        for p in self.pools:  # the CPU fields are filled per step by `upload`
            pools[p] = PoolTable(indptr=torch.empty(0, dtype=torch.int32), indices=view((p, "indices")),
                                 last_page_len=torch.empty(0, dtype=torch.int32),
                                 kv_lens=torch.empty(0, dtype=torch.int32), slot_page=view((p, "slot_page")),
                                 slot_offset=view((p, "slot_offset")), indptr_dev=view((p, "indptr")),
                                 kv_lens_dev=view((p, "kv_lens")))  # fmt: skip
        return GraphStepViews(view(("", "ids")), view(("", "pos")), view(("", "src")), pools)

    def upload(
        self, bs: int, ids: np.ndarray, positions: np.ndarray, row_src: np.ndarray, tables: dict[str, HostPoolArrays]
    ) -> GraphStepViews:
        """Write one step of B rows (graph padding included) and send it with one async copy. Returns the views,
        with each pool's CPU indptr / last_page_len / kv_lens (FlashInfer's plan reads those on the host)."""
        lay = self.layouts[bs]
        last = lay[(self.pools[-1], "indices")]
        n = last.offset + len(tables[self.pools[-1]].indices) * 4
        buf = np.zeros(n, np.uint8)

        def put(key: tuple[str, str], arr: np.ndarray) -> None:
            r = lay[key]
            if len(arr) > r.count:
                raise RuntimeError(f"decode graph inputs: {key[0] or 'tokens'} {key[1]} has {len(arr)} entries, "
                                   f"room for {r.count}")  # fmt: skip
            buf[r.offset : r.offset + len(arr) * r.dtype.itemsize] = np.ascontiguousarray(arr, r.dtype).view(np.uint8)

        put(("", "ids"), ids)
        put(("", "pos"), positions)
        put(("", "src"), row_src)
        for p in self.pools:
            a = tables[p]
            for name in ("slot_page", "slot_offset", "indptr", "kv_lens", "indices"):
                put((p, name), getattr(a, name))
        self.stage.upload(buf)
        v = self.views[bs]
        pools = {p: replace(v.pools[p], **tables[p].cpu_fields()) for p in self.pools}
        return GraphStepViews(v.input_ids, v.positions, v.row_src, pools)
