"""CUDA graphs for decode steps (FlashInfer backend).

Batch sizes 1, 2, 4, 8, then every 16 up to max_batch_size (and max_batch_size itself). A decode step of B
requests replays the smallest captured size >= B; the B..size-1 rows are dummy requests (one token at position
0, kv length 1 on the reserved dummy page 0 of every pool, K/V written to that page). Each size has its own
graph-mode decode wrapper set (flashinfer.md §6: the batch size is frozen per wrapper); `plan()` runs on the
host before every replay (never inside the graph).

What the graph holds: the decoder layers and the LM head, which writes into one static logits buffer shared by
every size (so the graphs' memory is the largest size's intermediates, not a sum of per-size outputs). The embedding, PLE inputs and RoPE lookup run
eagerly before the replay and write into static buffers: the model's `embed` builds a small CPU tensor per call
(an H2D copy that cannot be captured) and `_rope` checks `positions.max()` on the host. RoPE tables are sized to
max_model_len before capture; the tables used at capture are kept alive and a changed table disables replay.

With `fused_io` (toggle decode_io, perfkit/kernels/decode_io.py) the graph's soft-cap also writes each row's argmax
(`greedy`), which the engine's sampler takes instead of its own argmax; and where `Gemma4ForCausalLM.decode_rows`
applies, a step's host inputs (token ids, positions, which rows take the previous step's sampled ids, every pool's
slots and page table) arrive in one copy at addresses the graph captured (`inputs`, perfkit/runtime/graph_inputs.py;
the runner's `_prepare_graph_step` fills them), and the graph's first launch makes the embedding and RoPE rows from
them: no copy into static buffers and no launch before the replay.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from perfkit.runtime.graph_inputs import GraphStepInputs
from perfkit.runtime.page_table import AttentionMetadata, BatchState, HostPageTableBuilder, host_pool_arrays

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size] + list(range(16, max_batch_size + 1, 16))
    if max_batch_size not in sizes:
        sizes.append(max_batch_size)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model,
        backend,
        kv_cache,
        block_manager,
        max_batch_size: int,
        fused_io: bool = False,
        max_pages_per_row: dict[str, int] | None = None,
    ):
        """max_pages_per_row: the most pages one request holds per pool (the engine's bound), which sizes
        `inputs`' page-table regions; fused_io without it keeps the per-step uploads and copies."""
        self.model = model
        self.backend = backend
        self.kv = kv_cache
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_bs = self.sizes[-1]
        dev = model.device
        cfg = model.cfg
        n = self.max_bs
        self.rope = model.rope  # tables the graphs read; kept alive
        self.h = torch.zeros(n, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.ple = (
            torch.zeros(n, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input, dtype=model.dtype, device=dev)
            if cfg.has_ple
            else None
        )
        self.cos_sin = {
            s: tuple(torch.zeros(n, t.shape[1], dtype=t.dtype, device=dev) for t in self.rope.tables[s])
            for s in self.rope.tables
        }
        self.slot_page = {p: torch.zeros(n, dtype=torch.long, device=dev) for p in kv_cache.specs}
        self.slot_offset = {p: torch.zeros(n, dtype=torch.long, device=dev) for p in kv_cache.specs}
        # one logits buffer for every size (views of it are the graphs' outputs): per-graph outputs would all stay
        # allocated, ~1 MiB per row (fp32, 262K vocab), summed over the sizes
        self.logits_buf = torch.empty(n, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.bm = block_manager
        self._dummy_tables = HostPageTableBuilder(block_manager, dev, max_tokens=n, max_batch_size=n)
        self.greedy = None  # decode_io.GreedyIds: the argmax of every captured row, written by the graph
        self.inputs = None  # a step's host inputs in one copy, read in place by the graph (fused_io)
        if fused_io:
            from perfkit.kernels.decode_io import GreedyIds

            self.greedy = GreedyIds.new(n, cfg.vocab_size, dev)
            if model.decode_rows_apply() and max_pages_per_row is not None:
                self.inputs = GraphStepInputs(self.sizes, max_pages_per_row, dev)

    def size_for(self, batch: int, max_kv_end: int) -> int | None:
        """Captured size to replay for a pure-decode batch, or None (run eagerly)."""
        if batch > self.max_bs or self.model.rope is not self.rope or max_kv_end > self.rope.max_positions:
            return None
        for s in self.sizes:
            if s >= batch and s in self.graphs:
                return s
        return None

    # ---- capture ---------------------------------------------------------------------------------------------
    def _body(self, bs: int) -> torch.Tensor:
        rope = {s: (cs[0][:bs], cs[1][:bs]) for s, cs in self.cos_sin.items()}
        if self.inputs is not None:  # the inputs' rows, in the graph: the previous step's ids are the greedy buffer
            v = self.inputs.views[bs]
            self.model.decode_rows(v.input_ids, v.positions, self.h[:bs], rope, row_src=v.row_src,
                                   prev_ids=self.greedy.ids)  # fmt: skip
        h = self.model.decode_layers(self.h[:bs], rope, self.backend, None if self.ple is None else self.ple[:bs])
        return self.model.logits(h, out=self.logits_buf[:bs], greedy=None if self.greedy is None else self.greedy.head(bs))

    def _static_meta(self, meta: AttentionMetadata, bs: int) -> AttentionMetadata:
        pools = {}
        for p, pt in meta.pools.items():
            self.slot_page[p][:bs].copy_(pt.slot_page, non_blocking=True)
            self.slot_offset[p][:bs].copy_(pt.slot_offset, non_blocking=True)
            pools[p] = replace(pt, slot_page=self.slot_page[p][:bs], slot_offset=self.slot_offset[p][:bs])
        return replace(meta, pools=pools)

    def _prologue(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        bs = input_ids.shape[0]
        h, text_ids = self.model.embed(input_ids)
        self.h[:bs].copy_(h)
        if self.ple is not None:
            self.ple[:bs].copy_(self.model.per_layer_inputs(text_ids, h))
        for s, (c, sn) in self.rope.tables.items():
            self.cos_sin[s][0][:bs].copy_(c[positions])
            self.cos_sin[s][1][:bs].copy_(sn[positions])

    @torch.no_grad()
    def capture(self) -> None:
        pool = None
        empty = np.zeros(0, np.int64)
        for bs in reversed(self.sizes):
            self.backend.make_graph_wrappers(bs)
            dummies = BatchState([], empty, empty)
            if self.inputs is not None:
                zeros = np.zeros(bs, np.int64)
                tables = self.inputs.upload(bs, zeros, zeros, zeros - 1, host_pool_arrays(self.bm, dummies, bs)).pools
            else:
                tables = self._dummy_tables.build(dummies, pad_to=bs)
            meta = AttentionMetadata.graph_decode(bs, tables)
            if self.inputs is None:
                meta = self._static_meta(meta, bs)
                zeros_d = torch.zeros(bs, dtype=torch.long, device=self.h.device)
                self._prologue(zeros_d, zeros_d)
            self.backend.set_metadata(meta)
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._body(bs)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.logits[bs] = self._body(bs)
            except RuntimeError as e:  # e.g. a model path with a host sync at this size (MoE sorted experts)
                log.warning("decode graph for batch %d not captured (%s); that size runs eagerly", bs, e)
                continue
            pool = g.pool() if pool is None else pool
            self.graphs[bs] = g
        torch.cuda.synchronize()

    # ---- replay ----------------------------------------------------------------------------------------------
    def replay(self, inp) -> torch.Tensor:
        bs = inp.meta.graph_batch_size
        if self.inputs is not None:  # the step's one upload is in place already (ModelRunner._prepare_graph_step)
            self.backend.set_metadata(inp.meta)
        else:
            self._prologue(inp.input_ids, inp.positions)
            self.backend.set_metadata(self._static_meta(inp.meta, bs))  # plan outside the graph, every replay
        self.graphs[bs].replay()
        return self.logits[bs]

    def greedy_ids(self, rows: int) -> torch.Tensor | None:
        """The argmax ids of the last replay's first `rows` rows (fused_io), else None."""
        return None if self.greedy is None else self.greedy.ids[:rows]
