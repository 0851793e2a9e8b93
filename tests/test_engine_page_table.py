"""Page-table builders: `host` and `padded` give byte-identical indptr / indices / last_page_len (and the same
kv lengths and slots) on randomized batch states, with trimmed sliding pages and graph padding; on CPU and GPU."""

import random
import warnings

import numpy as np
import pytest
import torch

from perfkit.runtime.block_manager import BlockManager
from perfkit.runtime.page_table import BatchState, HostPageTableBuilder, PaddedPageTableBuilder

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]  # fmt: skip


def random_state(seed: int, ps: int = 4, window: int = 9):
    rng = random.Random(seed)
    bm = BlockManager({"sliding": 2000, "full": 4000}, ps, {"sliding": window, "full": None})
    ids, starts, qs = [], [], []
    for r in range(rng.randint(1, 40)):
        cached = rng.choice([0, rng.randint(0, 300)])
        q = 1 if rng.random() < 0.6 else rng.randint(1, 50)
        if cached:
            bm.allocate(r, cached)
            bm.trim(r, cached)
        bm.allocate(r, cached + q)
        ids.append(r)
        starts.append(cached)
        qs.append(q)
    order = sorted(range(len(ids)), key=lambda i: qs[i] != 1)  # decodes first, like the scheduler
    return bm, BatchState([ids[i] for i in order], np.array([starts[i] for i in order]),
                          np.array([qs[i] for i in order]))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(25))
def test_host_and_padded_builders_identical(device, seed):
    bm, state = random_state(seed)
    pad_to = None
    if seed % 3 == 0:
        pad_to = len(state.req_ids) + seed % 5
    a = HostPageTableBuilder(bm, device, max_tokens=64, max_batch_size=64).build(state, pad_to)
    b = PaddedPageTableBuilder(bm, device, max_tokens=64, max_batch_size=64).build(state, pad_to)
    for pool in bm.pools:
        x, y = a[pool], b[pool]
        for name in ("indptr", "last_page_len", "kv_lens"):
            tx, ty = getattr(x, name), getattr(y, name)
            assert tx.device.type == "cpu" and ty.device.type == "cpu" and tx.dtype == ty.dtype == torch.int32
            assert torch.equal(tx, ty), name
        assert x.indices.device.type == device and x.indices.dtype == y.indices.dtype == torch.int32
        assert x.indices.cpu().numpy().tobytes() == y.indices.cpu().numpy().tobytes()
        assert torch.equal(x.slot_page.cpu(), y.slot_page.cpu())
        assert torch.equal(x.slot_offset.cpu(), y.slot_offset.cpu())
        # the CSR table describes exactly the live pages; kv = (pages - 1) * ps + last
        counts = (x.indptr[1:] - x.indptr[:-1]).long()
        assert torch.equal((counts - 1) * bm.page_size + x.last_page_len.long(), x.kv_lens.long())
        assert bool(((x.last_page_len >= 1) & (x.last_page_len <= bm.page_size)).all())


def test_host_builder_slots_point_at_the_right_page():
    bm, state = random_state(7)
    t = HostPageTableBuilder(bm, "cpu", max_tokens=64, max_batch_size=64).build(state)
    k = 0
    for r, s, q in zip(state.req_ids, state.starts, state.q_lens, strict=True):
        for pos in range(s, s + q):
            for pool in bm.pools:
                pl = bm.page_list(r, pool)
                assert int(t[pool].slot_page[k]) == pl.pages[pos // bm.page_size - pl.first]
                assert int(t[pool].slot_offset[k]) == pos % bm.page_size
            k += 1


@pytest.mark.parametrize("seed", range(6))
def test_host_builder_slot_tensors_start_16_byte_aligned(seed):
    """Odd and even token counts alike: Triton specialises pointers on 16-byte alignment, so an unaligned
    slot_offset would compile a second fused-qkv variant in the first mixed step."""
    bm, state = random_state(seed)
    t = HostPageTableBuilder(bm, "cpu", max_tokens=64, max_batch_size=64).build(state)
    for pool in bm.pools:
        assert t[pool].slot_page.data_ptr() % 16 == 0 and t[pool].slot_offset.data_ptr() % 16 == 0
    assert {int(sum(random_state(s)[1].q_lens)) % 2 for s in range(6)} == {0, 1}  # both parities covered


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_upload_parts_start_each_part_on_16_bytes(dtype):
    """Any lengths: every part's view starts on a 16-byte boundary, holds exactly its array, and the padding is
    at most 16 / itemsize - 1 elements per part (the staging sizes of the page tables and the Triton decode)."""
    from perfkit.runtime.page_table import PinnedStaging

    np_dtype = np.int32 if dtype == torch.int32 else np.int64
    pad = 16 // torch.tensor([], dtype=dtype).element_size() - 1
    for n in range(1, 40):
        parts = [np.arange(n + 1, dtype=np_dtype) * 3, np.arange(n, dtype=np_dtype) + 100, np.arange(n % 3, dtype=np_dtype)]
        stage = PinnedStaging(sum(len(p) for p in parts) + pad * (len(parts) - 1), dtype, torch.device("cpu"))
        dev_before = stage.dev
        views = stage.upload_parts(parts)
        assert stage.dev is dev_before  # fits without growing
        for view, part in zip(views, parts, strict=True):
            assert view.data_ptr() % 16 == 0 and view.dtype == dtype
            assert np.array_equal(view.numpy(), part)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sync_count_host_vs_padded():
    """The host builder issues no device->host sync; the padded one does (it reads counts back)."""
    bm, state = random_state(3)
    counts = {}
    for name, cls in (("host", HostPageTableBuilder), ("padded", PaddedPageTableBuilder)):
        builder = cls(bm, "cuda", max_tokens=64, max_batch_size=64)
        builder.build(state)  # warm up allocations
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(5):
                    builder.build(state)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchroniz" in str(w.message) for w in rec) / 5
    print("syncs per build:", counts)
    assert counts["host"] == 0
    assert counts["padded"] >= 1
