"""Model runner: scheduler output -> device inputs (ids, positions, page tables, masks, mm embeds) -> logits.

`prepare` does all host work of a step and returns a `StepInputs`; `forward` runs the model eagerly or replays a
captured decode graph (pure-decode steps whose batch fits a captured size, padded with dummy requests).

Overlapped steps: a decode whose last token is still a scheduler PLACEHOLDER (sampled by the previous step, not
yet on the host) takes its input id on the device from that step's sampled ids (`prev_ids[req.pending_row]`), so
preparing this step never waits for the previous one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from perfkit.runtime.kv_cache import SLIDING_POOL
from perfkit.runtime.page_table import AttentionMetadata, BatchState, PinnedStaging, host_pool_arrays
from perfkit.runtime.scheduler import PLACEHOLDER, Request, SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # device long [T] (T includes graph padding)
    positions: torch.Tensor  # device long [T]
    logits_indices: torch.Tensor | None  # device long [S]: rows to sample, in chunk order of sampling chunks (None:
    # a graph step prepared by `_prepare_graph_step`, whose sampled rows are its first S)
    meta: AttentionMetadata
    mm_embeds: torch.Tensor | None
    sample_reqs: list[Request]


def _pending_rows(
    ids: np.ndarray, chunks: list, num_decodes: int, prev_ids: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a step's ids still holding a PLACEHOLDER (a decode whose last token the previous step sampled and
    the host does not have yet) and, for each, its row in `prev_ids`. Decodes come first, one token each, so row
    r < num_decodes is chunk r's token; a placeholder anywhere else, or without prev_ids, is a bug."""
    dst = np.nonzero(ids == PLACEHOLDER)[0]
    src = np.fromiter((chunks[r].req.pending_row for r in dst), np.int64, len(dst))
    if len(dst) and (prev_ids is None or dst[-1] >= num_decodes):
        raise RuntimeError("a placeholder token outside the decodes of the step after its sampling step")
    return dst, src


def _build_mask(token_types: torch.Tensor, q_lens, prefix_lens, window, impl: str, device) -> torch.Tensor:
    """Packed sliding-layer mask (perfkit.kernels.gemma_mask; falls back to the reference when unavailable).
    On a CPU device the Triton impl only runs under TRITON_INTERPRET=1; otherwise the dense impl is used."""
    try:
        from perfkit.kernels.gemma_mask import build_gemma_attention_mask
    except ImportError:  # no triton on this machine
        from perfkit.runtime.attention.torch_paged import reference_gemma_mask as build_gemma_attention_mask

        impl = "dense"
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        impl = "dense"
    return build_gemma_attention_mask(token_types.to(device), q_lens, prefix_lens, window, impl=impl)


class ModelRunner:
    def __init__(
        self, model, cfg, bm, page_tables, backend, *, max_num_tokens: int, vision_tower=None, ranges, memory
    ):
        self.model = model
        self.cfg = cfg
        self.bm = bm
        self.page_tables = page_tables  # HostPageTableBuilder | PaddedPageTableBuilder (toggle page_table)
        self.backend = backend  # toggle attention
        self.device = model.device
        self.vision_tower = vision_tower
        self.mask_impl = "triton"  # toggle mask
        self.mm_embed_cache = True  # toggle mm_embed_cache
        self.graphs = None  # DecodeGraphs when cuda_graphs=on and the backend supports them
        self.tok_stage = PinnedStaging(3 * max_num_tokens + 4096, torch.int64, self.device)  # + graph padding, fixes, alignment
        self._mm_cache: dict[int, torch.Tensor] = {}
        self._placeholder_ids = np.array([cfg.image_token_id, cfg.video_token_id])
        self.num_encoder_calls = 0
        self.max_images_per_encode = 8  # vision-tower batch cap (see _encode)
        self.ranges, self.memory = ranges, memory  # capture instruments (NVTX ranges, memory phases)

    # ---- prepare ---------------------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, prev_ids: torch.Tensor | None = None) -> StepInputs:
        """Host work of a step. `prev_ids`: device int64 sampled ids of the previous, not yet committed step
        (required when a scheduled decode's last token is a PLACEHOLDER)."""
        chunks = sched.chunks
        b = len(chunks)
        starts = np.fromiter((c.start for c in chunks), np.int64, b)
        q_lens = np.fromiter((c.num_tokens for c in chunks), np.int64, b)
        state = BatchState([c.req.request_id for c in chunks], starts, q_lens)
        graph_bs = None
        if self.graphs is not None and sched.num_decodes == b:
            graph_bs = self.graphs.size_for(b, int((starts + q_lens).max()))
        if graph_bs is not None and self.graphs.inputs is not None:
            return self._prepare_graph_step(sched, state, graph_bs, prev_ids)
        n_pad = 0 if graph_bs is None else graph_bs - b
        tables = self.page_tables.build(state, pad_to=graph_bs)

        n_tok = int(q_lens.sum())
        ids = np.fromiter((t for c in chunks for t in c.req.token_ids[c.start : c.end]), np.int64, n_tok)
        # token k of chunk r sits at position starts[r] + k: one vectorised expression, not an arange per chunk
        positions = np.repeat(starts - (np.cumsum(q_lens) - q_lens), q_lens) + np.arange(n_tok)
        ids = np.concatenate([ids, np.zeros(n_pad, np.int64)])
        positions = np.concatenate([positions, np.zeros(n_pad, np.int64)])
        qo = np.zeros(b + n_pad + 1, np.int64)
        np.cumsum(np.concatenate([q_lens, np.ones(n_pad, np.int64)]), out=qo[1:])
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        logits_idx = qo[1:][sampling] - 1
        t = len(ids)
        custom_mask = self._custom_mask(sched, tables)  # before the vision encode: its H2D copy waits for the GPU
        mm_embeds = self._mm_embeds(sched)
        dst, src = _pending_rows(ids, chunks, sched.num_decodes, prev_ids)
        # rare: with soft tokens in the step the model matches its image-token ids to mm_embeds' rows, which the
        # host counted, so a decode's id (it could be the image token) must be known here: read it back (a sync)
        if len(dst) and mm_embeds is not None:
            ids[dst] = prev_ids.cpu().numpy()[src]
            dst = src = dst[:0]
        ids[dst] = 0
        input_ids, positions_d, logits_indices, dst_d, src_d = self.tok_stage.upload_parts(
            [ids, positions, logits_idx, dst, src]
        )
        if len(dst):
            input_ids.index_copy_(0, dst_d, prev_ids.index_select(0, src_d))

        meta = AttentionMetadata(
            num_tokens=t,
            num_decodes=sched.num_decodes + n_pad,
            qo_indptr=torch.from_numpy(qo.astype(np.int32)),
            pools=tables,
            custom_mask=custom_mask,
            graph_batch_size=graph_bs,
        )
        return StepInputs(
            input_ids=input_ids,
            positions=positions_d,
            logits_indices=logits_indices,
            meta=meta,
            mm_embeds=mm_embeds,
            sample_reqs=[chunks[i].req for i in sampling],
        )

    def _prepare_graph_step(
        self, sched: SchedulerOutput, state: BatchState, bs: int, prev_ids: torch.Tensor | None
    ) -> StepInputs:
        """A decode-only step replayed from a graph that reads its inputs in place (`DecodeGraphs.inputs`, toggle
        decode_io): ids, positions, the rows whose token is the previous step's sampled id (`row_src`, gathered by
        the graph's first launch) and the host builder's tables in one upload; no launch here. The previous ids
        are read from the graph's greedy buffer: an eager step's sampled ids are copied there first."""
        chunks = sched.chunks
        b = len(chunks)
        ids = np.zeros(bs, np.int64)
        ids[:b] = [c.req.token_ids[c.start] for c in chunks]
        positions = np.zeros(bs, np.int64)
        positions[:b] = state.starts
        row_src = np.full(bs, -1, np.int64)
        dst, src = _pending_rows(ids[:b], chunks, b, prev_ids)
        if len(dst):
            row_src[dst] = src
            ids[dst] = 0
            greedy = self.graphs.greedy.ids
            if prev_ids.data_ptr() != greedy.data_ptr():
                greedy[: len(prev_ids)].copy_(prev_ids)
        v = self.graphs.inputs.upload(bs, ids, positions, row_src, host_pool_arrays(self.page_tables.bm, state, bs))
        meta = AttentionMetadata.graph_decode(bs, v.pools)
        return StepInputs(input_ids=v.input_ids, positions=v.positions, logits_indices=None, meta=meta,
                          mm_embeds=None, sample_reqs=[c.req for c in chunks if c.samples])  # fmt: skip

    def _custom_mask(self, sched: SchedulerOutput, tables) -> torch.Tensor | None:
        """Sliding-layer mask of the prefill chunks, only for bidirectional models with vision tokens in them."""
        if not self.cfg.bidirectional_vision or SLIDING_POOL not in tables:
            return None
        prefills = sched.chunks[sched.num_decodes :]
        types = [c.req.token_type_ids[c.start : c.end] for c in prefills]
        if not any(t in (1, 2) for ty in types for t in ty):
            return None
        kv_lens = tables[SLIDING_POOL].kv_lens.tolist()[sched.num_decodes : sched.num_decodes + len(prefills)]
        q_lens = [c.num_tokens for c in prefills]
        prefix = [kv - q for kv, q in zip(kv_lens, q_lens, strict=True)]
        flat = torch.tensor([t for ty in types for t in ty], dtype=torch.long)
        window = self.cfg.sliding_window
        with self.ranges.range("build_mask"), self.memory.phase("build_mask"):
            return _build_mask(flat, q_lens, prefix, window, self.mask_impl, self.device)

    # ---- multimodal ------------------------------------------------------------------------------------------
    def _encode(self, req: Request) -> torch.Tensor:
        """Soft tokens of every item of a request, in prompt order. Consecutive pixel items of the same patch count
        go through the vision tower as one batch (one launch sequence for N images instead of N), at most
        ``max_images_per_encode`` per call: the KV pool is sized after a text-only warmup, so the tower's
        activations must fit the headroom kv_cache_fraction leaves (32 images in one call ran out of memory next to
        a 0.9 pool on the H200: b200_nvfp4's 32 x 280 prefill on 12-01)."""
        rows: list[torch.Tensor] = []
        batch: list[tuple[torch.Tensor, torch.Tensor]] = []  # pending (pixel_values, pixel_position_ids)

        def flush() -> None:
            if not batch:
                return
            if self.vision_tower is None:
                raise RuntimeError("request has pixel inputs but the engine has no vision tower")
            pv = torch.cat([b[0] for b in batch]).to(self.device)  # [n_images, patches, 3*16*16]
            pp = torch.cat([b[1] for b in batch]).to(self.device)  # [n_images, patches, 2]
            self.num_encoder_calls += 1
            with self.ranges.range("mm_encode"), self.memory.phase("mm_encode"):
                rows.append(self.vision_tower(pv, pp))  # [n_soft_total, H]
            batch.clear()

        for item in req.mm_items:
            if isinstance(item, torch.Tensor):  # precomputed soft tokens [n, H]
                flush()
                rows.append(item.to(self.device))
                continue
            pv = item["pixel_values"] if isinstance(item, dict) else item.pixel_values
            pp = item["pixel_position_ids"] if isinstance(item, dict) else item.pixel_position_ids
            if batch and (batch[0][0].shape[1:] != pv.shape[1:] or len(batch) >= self.max_images_per_encode):
                flush()
            batch.append((pv, pp))
        flush()
        return torch.cat(rows).to(self.model.dtype)

    def _request_embeds(self, req: Request) -> torch.Tensor:
        """mm_embed_cache=on: encode once per request, slice per chunk. off: re-encode all items every chunk."""
        if not self.mm_embed_cache:
            return self._encode(req)
        if req.request_id not in self._mm_cache:
            self._mm_cache[req.request_id] = self._encode(req)
        return self._mm_cache[req.request_id]

    def release(self, req_id: int) -> None:
        self._mm_cache.pop(req_id, None)

    def _mm_embeds(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Rows for every image/video placeholder of the step, in token order. Placeholders of the prompt of a
        request with mm_items take the request's soft tokens; any other placeholder id (a generated token, a
        prompt without items) gets its own text embedding, exactly what the model computes without mm_embeds."""
        if not any(c.req.mm_items for c in sched.chunks):
            return None  # no soft tokens to merge (the common text-only step): skip the per-chunk placeholder scan
        parts: list[torch.Tensor] = []
        text_ids: list[tuple[int, int]] = []  # (index into parts, token id) filled after the loop
        any_vision = False
        for c in sched.chunks:
            req = c.req
            toks = np.asarray(req.token_ids[c.start : c.end])
            ph = np.nonzero(np.isin(toks, self._placeholder_ids))[0] + c.start
            if len(ph) == 0:
                continue
            in_prompt = ph[ph < req.prompt_len] if req.mm_items else ph[:0]
            if len(in_prompt):
                any_vision = True
                prompt = np.asarray(req.token_ids[: req.prompt_len])
                before = int(np.isin(prompt[: c.start], self._placeholder_ids).sum())
                parts.append(self._request_embeds(req)[before : before + len(in_prompt)])
            for p in ph[len(in_prompt) :]:
                text_ids.append((len(parts), req.token_ids[p]))
                parts.append(None)
        if not any_vision:
            return None
        if text_ids:
            h, _ = self.model.embed(torch.tensor([t for _, t in text_ids], device=self.device))
            for k, (i, _) in enumerate(text_ids):
                parts[i] = h[k : k + 1]
        return torch.cat(parts)

    # ---- forward ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """-> float32 logits [S, V], one row per sampling chunk."""
        if inp.meta.graph_batch_size is not None:
            logits = self.graphs.replay(inp)
            return logits[: len(inp.sample_reqs)]
        self.backend.set_metadata(inp.meta)
        return self.model(inp.input_ids, inp.positions, self.backend, inp.mm_embeds, inp.logits_indices)

    def greedy_ids(self, inp: StepInputs) -> torch.Tensor | None:
        """The argmax of each sampled row of `inp`'s logits where the step's graph computed it (toggle decode_io),
        else None. Valid until the next replay: the sampler reads it first, in stream order."""
        if inp.meta.graph_batch_size is None or self.graphs is None:
            return None
        return self.graphs.greedy_ids(len(inp.sample_reqs))
