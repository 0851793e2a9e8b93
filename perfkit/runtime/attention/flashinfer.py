"""FlashInfer attention backend (GPU, flashinfer-python 0.7.2.post1; see shared/reference/flashinfer.md).

Per pool (sliding hd256 + window, full hd512): one BatchPrefillWithPagedKVCacheWrapper (no custom mask, backend
"auto": FA3 may be picked for hd256), one for custom masks (sliding pool, FA2 pinned, since a wrapper keeps the
backend it resolved on its first plan), one BatchDecodeWithPagedKVCacheWrapper, and per captured CUDA-graph
batch size one graph-mode decode wrapper with persistent index buffers. All share one float workspace (the
wrappers run one after another on one stream).

Mixed batches: the scheduler puts decodes first, so the decode wrapper runs on q[:num_decodes] and the prefill
wrapper on the rest. Why split instead of planning everything as prefill: the decode path is then the same
kernel in mixed, pure-decode and graph-replayed steps (one numerical path per request phase), and the prefill
wrapper, which may need a custom mask (FA2) or runs FA3, never sees the B decode rows.

plan() runs once per step (in `set_metadata`, outside any graph) with CPU indptr / last_page_len and DEVICE
indices. A CUDA event after each plan guards the wrapper's pinned host buffer: the next plan of the same
wrapper waits for it (flashinfer.md §5.2 hazard). `sm_scale=1.0`, `window_left = W - 1` on sliding layers.
Custom masks are passed unpacked (`custom_mask=`): plan() packs them with segment_packbits and uses the packed
byte offsets. Passing `packed_custom_mask=` instead would pair the packed bits with the *unpacked* bit offsets
that plan computes from qo/kv lengths (wrong for every request but the first).

FP8 KV (cache dtype float8_e4m3fn, Q stays bf16): plan() gets `kv_data_type=float8_e4m3fn` (auto then resolves
FA2 for prefill: FA3 needs fp8 Q), `write_kv` quantises with the cache layer's fixed scales, and every run() gets
them as Python floats (`k_scale` folds into sm_scale, `v_scale` multiplies the output). The scales are constants
per layer, so graph capture records them like any other launch argument.

Decode rows may instead run perfkit's split-KV Triton kernel (`perfkit.kernels.paged_decode`; toggle
`decode_attention=flashinfer|triton|auto`, auto = Triton up to `TRITON_DECODE_MAX_BATCH` decode rows): FlashInfer's
decode is latency-bound at small batches. That kernel reads the page table on the device, so `set_metadata` uploads
the decode rows' indptr and kv lengths into a fixed device buffer per pool (pinned staging, one async copy) and,
for a graph replay, copies the indices into a fixed buffer too: a captured launch reads the same addresses at every
replay, and the builders' own index buffers differ between capture (DecodeGraphs' dummy tables) and replay.

The Triton decode's split-KV slices are merged by a launch of their own, or (toggle decode_merge=fused; default launch,
which measured faster on the H200) where the merge is small by the last slice of each (row, kv head) in the decode
launch itself, through a counter per pair that the backend owns (`paged_decode.new_merge_counter`; every launch
leaves it at zero, so the layers share it).

`attend_raw` (toggle decode_prologue, default separate): at a decode-only step on a Triton plan, the model hands
over the raw q / k / v projections and that kernel does the q/k norm + RoPE launch's work itself
(`paged_decode_attention`'s prologue; slower than the separate launch on the H200, see that module's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfkit.errors import PerfkitError
from perfkit.kernels.launch import sm_count
from perfkit.kernels.paged_decode import DecodePrologue, new_merge_counter, paged_decode_attention, pick_splits
from perfkit.runtime.attention.base import AttnLayer
from perfkit.runtime.attention.torch_paged import kv_write_target, write_layer_kv
from perfkit.runtime.kv_cache import SLIDING_POOL, PagedKVCache
from perfkit.runtime.page_table import AttentionMetadata, PinnedStaging, PoolTable

DECODE_KERNELS = ("auto", "flashinfer", "triton")
# decode_attention=auto: the Triton kernel up to this many decode rows. H200 12-03 (configs/ab_decode_attention.yaml,
# docs/h200-runs/2026-12-03/2-*), bf16, both kernels in one run, forward_decode device mean flashinfer -> triton:
# 31B c1 17.18 -> 16.92 ms, c4 18.28 -> 17.72, c8 18.74 -> 18.60; 26B-A4B c1 3.888 -> 3.723, c4 6.334 -> 5.804,
# c8 8.600 -> 8.273 (two repeats each within 0.01 ms, SM clocks within 0.7 %). Above 8 it is no better
# (12-04 call 2, docs/h200-runs/2026-12-04/2-*): 31B c16 20.91 -> 20.97 ms, c32 24.87 -> 24.26 with the triton arm's
# SM clock 2.9 % higher; 26B-A4B c16 12.37 -> 12.32, c32 16.30 -> 16.26. With 12-04's merge, c1: 31B 17.03 -> 16.70,
# 26B-A4B 3.907 -> 3.694 (12-04 call 4).
TRITON_DECODE_MAX_BATCH = 8


def window_left(window: int | None) -> int:
    """FlashInfer's ``window_left`` for a pool whose query sees keys j with i - j < W: W - 1; -1 = no window."""
    return window - 1 if window is not None else -1


TENSOR_CORE_MAX_BATCH = 1  # small-group pools use tensor-core decode up to this batch (measured, see below)


def default_use_tensor_cores(num_heads: int, num_kv_heads: int, batch_size: int) -> bool:
    """Tensor-core decode (FlashInfer's FA2 prefill kernels) or its CUDA-core decode kernel, chosen by measurement.

    ``perfkit kernels attention`` on the H200 (docs/h200-runs/2026-12-01b/{1,2}-attention-*.json, L2-cold graphs):
    with a GQA group >= 4 (the hd512 full pools) tensor cores win at every batch, 2-2.6x (31B b64 kv4096 555 vs
    1408 us). The group-2 sliding pools (hd256) win with tensor cores only at batch 1 (31B 13.7 vs 16.2 us, 26B-A4B
    11.4 vs 14.8 us); from batch 2 on the CUDA-core kernel is faster (31B b2 18.7 vs 20.5, b4 27.0 vs 30.4, b8 45.8
    vs 49.6, b64 267 vs 284 us; 26B b16 42.5 vs 46.6 us). (flashinfer.md's rule of thumb was the group alone.)
    """
    return num_heads // num_kv_heads >= 4 or batch_size <= TENSOR_CORE_MAX_BATCH


def use_triton_decode(decode_kernel: str, batch_size: int) -> bool:
    """Which kernel runs a step's decode rows: ``decode_kernel`` itself, or for auto the Triton split-KV kernel up
    to TRITON_DECODE_MAX_BATCH rows (the latency-bound sizes) and FlashInfer's decode above."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_attention {decode_kernel!r}: allowed values are {', '.join(DECODE_KERNELS)}")
    return decode_kernel == "triton" or (decode_kernel == "auto" and batch_size <= TRITON_DECODE_MAX_BATCH)


@dataclass
class TritonDecodePlan:
    """One pool's decode rows for `paged_decode_attention`, every tensor on the device."""

    indices: torch.Tensor  # int32 [nnz]
    indptr: torch.Tensor  # int32 [B + 1]
    kv_lens: torch.Tensor  # int32 [B]
    num_splits: int
    window: int | None


class FlashInferBackend:
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self,
        kv_cache: PagedKVCache,
        workspace_bytes: int = 256 << 20,
        decode_use_tensor_cores: bool | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        prefill_backend: str = "auto",
        decode_kernel: str = "auto",
        max_batch_size: int = 256,
        pdl: bool = False,
        decode_prologue: bool = False,
        decode_merge: str = "launch",
    ):
        try:
            import flashinfer
        except ImportError as e:
            raise PerfkitError(
                "attention=flashinfer needs flashinfer-python==0.7.2.post1 (pip install 'perfkit[gpu]'); "
                "use attention=torch on machines without it"
            ) from e
        if kv_cache.device.type != "cuda":
            raise PerfkitError("attention=flashinfer needs a CUDA device; use attention=torch")
        self.fi = flashinfer
        self.kv = kv_cache
        self.device = kv_cache.device
        self.q_dtype = q_dtype
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.tensor_cores_flag = decode_use_tensor_cores  # None: by pool and batch (default_use_tensor_cores)
        # prefill "auto": FA3 on the hd256 sliding pool, FA2 on hd512 (FA3 does not build for it). Measured with
        # `perfkit kernels attention` (H200): FA3 is 13 % faster at a 31B 8K sliding prefill (904 vs 1038 us)
        self.prefill = {p: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                           backend=prefill_backend)
                        for p in kv_cache.specs}  # fmt: skip
        self.prefill_masked = {SLIDING_POOL: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")} if SLIDING_POOL in kv_cache.specs else {}  # fmt: skip
        self.decode: dict[tuple[str, bool], object] = {}  # (pool, tensor cores) -> eager decode wrapper
        self.graph_decode: dict[int, dict] = {}  # batch size -> pool -> wrapper (use_cuda_graph=True)
        self._events: dict[int, torch.cuda.Event] = {}
        self.meta: AttentionMetadata | None = None
        self._active: dict[str, tuple] = {}  # pool -> (decode wrapper | TritonDecodePlan | None, prefill wrapper | None)
        use_triton_decode(decode_kernel, 1)  # validates the value
        self.decode_kernel = decode_kernel  # toggle decode_attention
        self.pdl = pdl  # toggle pdl: the Triton decode's two kernels launch with PDL (FlashInfer's never do)
        self.decode_prologue = decode_prologue  # toggle decode_prologue: attend_raw folds q/k norm + RoPE in
        self.decode_merge = decode_merge  # toggle decode_merge: fused = the slices merged in the decode launch
        # its counters: one per (row, kv head), left at zero by every launch, shared by the layers in turn
        self._merge_count = new_merge_counter(max_batch_size, max(s.num_kv_heads for s in kv_cache.specs.values()),
                                              self.device)  # fmt: skip
        # the Triton decode's device metadata: fixed addresses (graphs), sized for the engine's largest batch, + 3
        # for the lengths' 16-byte start (upload_parts)
        self._tri_meta = {p: PinnedStaging(2 * max_batch_size + 4, torch.int32, self.device) for p in kv_cache.specs}
        self._tri_indices = {p: torch.zeros(kv_cache.num_pages[p] + max_batch_size, dtype=torch.int32,
                                            device=self.device) for p in kv_cache.specs}  # fmt: skip

    def tensor_cores(self, pool: str, batch_size: int) -> bool:
        if self.tensor_cores_flag is not None:
            return self.tensor_cores_flag
        spec = self.kv.specs[pool]
        return default_use_tensor_cores(spec.num_heads, spec.num_kv_heads, batch_size)

    def _eager_decode(self, pool: str, batch_size: int):
        key = (pool, self.tensor_cores(pool, batch_size))
        if key not in self.decode:
            self.decode[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=key[1]
            )
        return self.decode[key]

    # ---- CUDA graph wrappers ---------------------------------------------------------------------------------
    def make_graph_wrappers(self, batch_size: int) -> None:
        if batch_size in self.graph_decode:
            return
        wrappers = {}
        for p in self.kv.specs:
            wrappers[p] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores(p, batch_size),
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(self.kv.num_pages[p] + batch_size, dtype=torch.int32,
                                                    device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
            )  # fmt: skip
        self.graph_decode[batch_size] = wrappers

    # ---- per-step planning -----------------------------------------------------------------------------------
    def _triton_decode_plan(self, pool: str, pt: PoolTable, nd: int, graph: bool) -> TritonDecodePlan:
        """Upload the decode rows' indptr and kv lengths (one async copy from pinned staging; no sync) and, for a
        graph replay, copy their page indices into the fixed buffer the captured launch reads; or take the three
        where the step's one upload put them (`PoolTable.indptr_dev`: decode graphs with perfkit/runtime/graph_inputs.py)."""
        spec = self.kv.specs[pool]
        if pt.indptr_dev is not None and pt.kv_lens_dev is not None:  # uploaded with the step (graph_inputs.py),
            indptr, kv_lens, indices = pt.indptr_dev, pt.kv_lens_dev, pt.indices  # at the addresses captured
        else:
            indptr, kv_lens = self._tri_meta[pool].upload_parts([pt.indptr[: nd + 1].numpy(),
                                                                 pt.kv_lens[:nd].numpy()])  # fmt: skip
            nnz = int(pt.indptr[nd])
            indices = pt.indices[:nnz]
            if graph:
                self._tri_indices[pool][:nnz].copy_(indices, non_blocking=True)
                indices = self._tri_indices[pool]
        splits = pick_splits(nd, spec.num_kv_heads, sm_count(self.device), spec.window)
        return TritonDecodePlan(indices, indptr, kv_lens, splits, spec.window)

    def _plan(self, wrapper, fn, *args, **kw) -> None:
        ev = self._events.get(id(wrapper))
        if ev is not None and not ev.query():
            ev.synchronize()  # the H2D copy of this wrapper's previous plan has run: its pinned buffer is free
        fn(*args, **kw)
        ev = self._events.setdefault(id(wrapper), torch.cuda.Event())
        ev.record()

    def set_metadata(self, meta: AttentionMetadata) -> None:
        """Plan every wrapper the step uses (outside CUDA graphs; before every replay)."""
        self.meta = meta
        nd, b = meta.num_decodes, meta.batch_size
        kv_dtype = self.kv.dtype
        self._active = {}
        for pool, pt in meta.pools.items():
            spec = self.kv.specs[pool]
            common = dict(
                window_left=window_left(spec.window), sm_scale=1.0, q_data_type=self.q_dtype, kv_data_type=kv_dtype
            )
            dec = pre = None
            if nd and use_triton_decode(self.decode_kernel, nd):
                dec = self._triton_decode_plan(pool, pt, nd, graph=meta.graph_batch_size is not None)
            elif nd:
                dec = (self.graph_decode[meta.graph_batch_size][pool] if meta.graph_batch_size
                       else self._eager_decode(pool, nd))  # fmt: skip
                nnz = int(pt.indptr[nd])
                self._plan(dec, dec.plan, pt.indptr[: nd + 1], pt.indices[:nnz], pt.last_page_len[:nd],
                           spec.num_heads, spec.num_kv_heads, spec.head_dim, self.kv.page_size,
                           non_blocking=True, **common)  # fmt: skip
            if b > nd:
                masked = meta.custom_mask is not None and pool in self.prefill_masked
                pre = self.prefill_masked[pool] if masked else self.prefill[pool]
                start = int(pt.indptr[nd])
                self._plan(pre, pre.plan, meta.qo_indptr[nd:] - meta.qo_indptr[nd], pt.indptr[nd:] - start,
                           pt.indices[start:], pt.last_page_len[nd:], spec.num_heads, spec.num_kv_heads,
                           spec.head_dim, self.kv.page_size, causal=True,
                           custom_mask=meta.custom_mask if masked else None, non_blocking=True, **common)  # fmt: skip
            self._active[pool] = (dec, pre)

    # ---- attention -------------------------------------------------------------------------------------------
    def kv_write_target(self, layer: AttnLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
        """(cache, slot_page, slot_offset, k_scale, v_scale) for the fused qkv kernel's own K/V write, fp8 caches
        included (None on KV-shared layers). Under CUDA graphs the slots are DecodeGraphs' static buffers
        (set_metadata gets the static meta before capture and every replay), so the captured kernel writes where
        each replay's slots point."""
        return kv_write_target(self.kv, self.meta, layer)

    def attend(self, layer: AttnLayer, q: torch.Tensor, k, v) -> torch.Tensor:
        meta = self.meta
        cache, pool, k_scale, v_scale = write_layer_kv(self.kv, meta, layer, k, v)
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.kv.is_fp8 else {}
        dec, pre = self._active[pool]
        nd = meta.num_decodes
        q = q.to(self.q_dtype)
        out = torch.empty_like(q)
        if isinstance(dec, TritonDecodePlan):
            paged_decode_attention(q[:nd], cache, dec.indices, dec.indptr, dec.kv_lens, window=dec.window,
                                   k_scale=k_scale, v_scale=v_scale, num_splits=dec.num_splits, out=out[:nd],
                                   pdl=self.pdl, merge_counter=self._merge_counter())  # fmt: skip
        elif dec is not None:
            dec.run(q[:nd], cache, out=out[:nd], **scales)
        if pre is not None:
            pre.run(q[nd:], cache, out=out[nd:], **scales)
        return out

    def attend_raw(
        self, layer: AttnLayer, q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_raw: torch.Tensor | None,
        q_weight: torch.Tensor, k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
    ) -> torch.Tensor | None:  # fmt: skip
        """Attention from the raw projections (toggle decode_prologue): at a decode-only step on a Triton plan the
        decode kernel norms and ropes q itself and makes, writes and uses the newest K / V row (the work of the
        qkv_norm_rope launch; `paged_decode_attention`'s prologue). q_raw [T, nh, hd], k_raw / v_raw [T, kvh, hd]
        (k_raw None: a KV-shared layer; v_raw None: K=V). Returns [T, nh, hd], or None when this step cannot
        (toggle off, a prefill row in the step, FlashInfer's decode, another dtype): then the caller takes the
        separate path. The slots are the step's static buffers under CUDA graphs, read on the device."""
        meta = self.meta
        if not self.decode_prologue or meta.num_decodes != meta.batch_size or q_raw.dtype != self.q_dtype:
            return None
        cache, pool, k_scale, v_scale = write_layer_kv(self.kv, meta, layer, None, None)  # writes nothing
        dec = self._active[pool][0]
        if not isinstance(dec, TritonDecodePlan) or q_raw.shape[0] != meta.num_decodes:
            return None
        if cache.dtype != q_raw.dtype and not self.kv.is_fp8:
            return None
        if layer.writes_kv != (k_raw is not None):
            raise ValueError(f"layer {layer.index}: k_raw must be given exactly on layers that write KV")
        pt = meta.pools[pool]
        pro = DecodePrologue(q_weight, cos, sin, eps, k_raw, v_raw, k_weight, pt.slot_page, pt.slot_offset)
        return paged_decode_attention(q_raw, cache, dec.indices, dec.indptr, dec.kv_lens, window=dec.window,
                                      k_scale=k_scale, v_scale=v_scale, num_splits=dec.num_splits, pdl=self.pdl,
                                      prologue=pro, merge_counter=self._merge_counter())  # fmt: skip

    def _merge_counter(self) -> torch.Tensor | None:
        """The Triton decode's merge counters under decode_merge=fused (the kernel takes them where the merge is
        small: `paged_decode.fused_merge_fits`), else None (the merge launch)."""
        return self._merge_count if self.decode_merge == "fused" else None
