"""A decode-graph step's inputs in one upload (perfkit/runtime/graph_inputs.py, toggle decode_io): the fixed
layouts, the round trip through the views, and the runner's graph-step preparation against its standard path on a
CPU engine (the graph itself needs CUDA: tests/test_decode_io.py runs the engine on the GPU)."""

import numpy as np
import pytest
import torch

from perfkit.runtime.graph_inputs import GraphStepInputs
from perfkit.runtime.page_table import HostPoolArrays
from tests.test_engine_cpu import cpu_engine, model_for, random_prompts, run_staggered

CPU = torch.device("cpu")
PAGES = {"sliding": 3, "full": 5}


def _tables(bs: int, seed: int) -> dict[str, HostPoolArrays]:
    rng = np.random.default_rng(seed)
    out = {}
    for p, cap in PAGES.items():
        counts = rng.integers(1, cap + 1, bs)
        indptr = np.concatenate([[0], np.cumsum(counts)])
        out[p] = HostPoolArrays(indptr=indptr, indices=rng.integers(1, 99, indptr[-1]).astype(np.int32),
                                last_page_len=rng.integers(1, 5, bs), kv_lens=rng.integers(1, 60, bs),
                                slot_page=rng.integers(1, 99, bs), slot_offset=rng.integers(0, 4, bs))  # fmt: skip
    return out


def test_layouts_are_aligned_and_disjoint():
    gi = GraphStepInputs([1, 2, 4, 8], PAGES, CPU)
    for lay in gi.layouts.values():
        regions = sorted(lay.values(), key=lambda r: r.offset)
        assert all(r.offset % 16 == 0 for r in regions)
        assert all(a.end <= b.offset for a, b in zip(regions, regions[1:], strict=False))
    assert gi.stage.dev.numel() >= max(r.end for r in gi.layouts[8].values())


@pytest.mark.parametrize("bs", [1, 4])
def test_upload_round_trip_at_the_captured_addresses(bs):
    """Every value lands in its region; the views of a step are the size's fixed views (what a graph captured)."""
    gi = GraphStepInputs([1, 4], PAGES, CPU)
    for seed in range(3):
        ids, pos, src = (np.arange(bs) + 10 * seed, np.arange(bs) + 100, np.full(bs, -1) + seed)
        tables = _tables(bs, seed)
        v = gi.upload(bs, ids, pos, src, tables)
        fixed = gi.views[bs]
        assert v.input_ids.tolist() == ids.tolist() and v.positions.tolist() == pos.tolist()
        assert v.row_src.tolist() == src.tolist()
        assert v.input_ids.data_ptr() == fixed.input_ids.data_ptr()
        for p, a in tables.items():
            pt, pf = v.pools[p], fixed.pools[p]
            nnz = int(a.indptr[-1])
            assert pt.indices[:nnz].tolist() == a.indices.tolist()
            assert pt.indptr_dev.tolist() == a.indptr.tolist() and pt.indptr.tolist() == a.indptr.tolist()
            assert pt.kv_lens_dev.tolist() == a.kv_lens.tolist() and pt.kv_lens.tolist() == a.kv_lens.tolist()
            assert pt.last_page_len.tolist() == a.last_page_len.tolist()
            assert pt.slot_page.tolist() == a.slot_page.tolist() and pt.slot_offset.tolist() == a.slot_offset.tolist()
            for name in ("indices", "slot_page", "slot_offset", "indptr_dev", "kv_lens_dev"):
                assert getattr(pt, name).data_ptr() == getattr(pf, name).data_ptr()
            assert pt.indptr_dev.dtype == torch.int32 and pt.slot_page.dtype == torch.int64


def test_upload_refuses_a_table_larger_than_its_region():
    gi = GraphStepInputs([2], PAGES, CPU)
    tables = _tables(2, 0)
    tables["sliding"].indices = np.ones(2 * PAGES["sliding"] + 1, np.int32)
    with pytest.raises(RuntimeError, match="sliding indices has 7 entries, room for 6"):
        gi.upload(2, np.zeros(2), np.zeros(2), np.zeros(2), tables)


class _Graphs:
    """What `ModelRunner.prepare` needs of DecodeGraphs to take the one-upload path (no CUDA graph here)."""

    def __init__(self, sizes, pages, vocab):
        from perfkit.kernels.decode_io import GreedyIds

        self.sizes = sizes
        self.inputs = GraphStepInputs(sizes, pages, CPU)
        self.greedy = GreedyIds.new(max(sizes), vocab, CPU)

    def size_for(self, batch: int, max_kv_end: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)


def test_graph_step_preparation_matches_the_standard_path():
    """On a CPU engine with overlapped steps (decodes whose token is still on the device): for every decode-only
    step, the one upload holds the standard path's tables in its first B rows, the rows' tokens after the graph's
    gather (`row_src` into the greedy buffer, an eager step's ids copied there) are the standard path's input ids,
    and the same requests sample."""
    cfg, model = model_for("tiny")
    eng = cpu_engine(model, cfg, page_size=4, max_batch_size=8)
    runner = eng.runner
    pages = {p: eng._pages_needed(spec.window, eng.ec.max_model_len) for p, spec in eng.kv.specs.items()}
    fake = _Graphs([1, 2, 4, 8], pages, cfg.vocab_size)
    standard = runner.prepare
    checked = {"steps": 0, "gathered": 0}

    def prepare(sched, prev_ids=None):
        ref = standard(sched, prev_ids)
        if not sched.chunks or sched.num_decodes != len(sched.chunks):
            return ref
        runner.graphs = fake
        try:
            got = standard(sched, prev_ids)
        finally:
            runner.graphs = None
        b, bs = len(sched.chunks), got.meta.graph_batch_size
        assert bs == fake.size_for(b, 0) and got.logits_indices is None
        src = fake.inputs.views[bs].row_src[:b]
        tokens = torch.where(src >= 0, fake.greedy.ids[src.clamp(min=0)], got.input_ids[:b])
        assert tokens.tolist() == ref.input_ids.tolist()
        assert got.positions[:b].tolist() == ref.positions.tolist()
        assert [r.request_id for r in got.sample_reqs] == [r.request_id for r in ref.sample_reqs]
        for p, rt in ref.meta.pools.items():
            gt = got.meta.pools[p]
            nnz = int(rt.indptr[-1])
            assert gt.indptr[: b + 1].tolist() == rt.indptr.tolist()
            assert gt.indptr_dev[: b + 1].tolist() == rt.indptr.tolist()
            assert gt.indices[:nnz].tolist() == rt.indices.tolist()
            assert gt.kv_lens_dev[:b].tolist() == rt.kv_lens.tolist()
            assert gt.last_page_len[:b].tolist() == rt.last_page_len.tolist()
            assert gt.slot_page[:b].tolist() == rt.slot_page.tolist()
            assert gt.slot_offset[:b].tolist() == rt.slot_offset.tolist()
        checked["steps"] += 1
        checked["gathered"] += int((src >= 0).sum())
        return ref

    runner.prepare = prepare
    prompts = random_prompts(6, seed=4, lo=3, hi=30)
    run_staggered(eng, prompts, [9, 4, 12, 7, 5, 10], [0, 0, 1, 3, 3, 6])
    assert checked["steps"] > 5 and checked["gathered"] > 5
    eng.bm.check_no_leaks()
