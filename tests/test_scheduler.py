"""Scheduler invariants on a fake deterministic model: budget, batch size, blobs never split, preemption by
recompute leaves the (greedy) output unchanged, no page leaks."""

import random

from perfkit.runtime.block_manager import BlockManager
from perfkit.runtime.scheduler import Request, Scheduler


def fake_next(tokens: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of the whole prefix."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return h % 97


def make_requests(n: int, seed: int, with_blobs: bool = True):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        ids, types = [], []
        for _ in range(rng.randint(1, 4)):
            k = rng.randint(1, 12)
            ids += [rng.randint(3, 90) for _ in range(k)]
            types += [0] * k
            if with_blobs and rng.random() < 0.5:
                k = rng.randint(1, 14)
                t = rng.choice([1, 2, 3])
                ids += [99] * k
                types += [t] * k
        reqs.append((i, ids, types, rng.randint(1, 20), rng.randint(0, 30)))  # id, ids, types, max_new, arrival
    return reqs


def simulate(specs, num_pages, max_batch, max_tokens, page_size=4, window=6):
    bm = BlockManager({"sliding": num_pages, "full": num_pages}, page_size, {"sliding": window, "full": None})
    s = Scheduler(bm, max_batch, max_tokens)
    pending = sorted(specs, key=lambda x: x[4])
    outputs: dict[int, list[int]] = {}
    step = 0
    while pending or s.has_unfinished():
        while pending and pending[0][4] <= step:
            rid, ids, types, max_new, _ = pending.pop(0)
            s.add(Request(rid, list(ids), list(types), max_new))
        step += 1
        out = s.schedule()
        assert len(s.running) <= max_batch
        # budget: only a lone, atomic, oversize blob may exceed it
        if out.num_tokens > max_tokens:
            assert len(out.chunks) == 1
            c = out.chunks[0]
            assert c.req.blob_start[c.start] == c.start and c.req.blob_end[c.start] == c.end
        assert [c.is_decode for c in out.chunks] == sorted((c.is_decode for c in out.chunks), reverse=True)
        sampled = []
        for c in out.chunks:
            r = c.req
            assert c.start == r.num_computed
            assert not r.splits_blob(c.start) and not r.splits_blob(c.end)
            for p in bm.pools:  # pages cover the chunk
                pl = bm.page_list(r.request_id, p)
                assert pl.end * page_size >= c.end and pl.first * page_size <= max(0, c.start - (window - 1))
            if c.samples:
                sampled.append(fake_next(r.token_ids))
        for o in s.postprocess(out, sampled, 0):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        bm.check_no_leaks()
        assert step < 100_000
    assert not bm.tables
    assert bm.num_free("sliding") == num_pages - 1 and bm.num_free("full") == num_pages - 1
    return outputs, s.num_preemptions


def reference(specs):
    out = {}
    for rid, ids, _, max_new, _ in specs:
        toks = list(ids)
        gen = []
        for _ in range(max_new):
            t = fake_next(toks)
            toks.append(t)
            gen.append(t)
        out[rid] = gen
    return out


def test_thousand_random_requests_no_leaks_and_exact_outputs():
    specs = make_requests(1000, seed=1)
    outputs, _ = simulate(specs, num_pages=400, max_batch=16, max_tokens=24)
    assert outputs == reference(specs)


def test_preemption_restores_identical_output():
    specs = make_requests(60, seed=2)
    big, n_big = simulate(specs, num_pages=2000, max_batch=8, max_tokens=32)
    small, n_small = simulate(specs, num_pages=30, max_batch=8, max_tokens=32)
    assert n_big == 0 and n_small > 0
    assert big == small == reference(specs)


def test_oversize_blob_is_scheduled_whole_when_alone():
    ids = [5, 6] + [99] * 20 + [7]
    types = [0, 0] + [1] * 20 + [0]
    specs = [(0, ids, types, 3, 0), (1, [3, 4, 5], [0, 0, 0], 30, 0)]
    outputs, _ = simulate(specs, num_pages=100, max_batch=4, max_tokens=8)
    assert outputs == reference(specs)


def test_chunks_and_blobs_many_budgets():
    for budget in (1, 2, 5, 13):
        specs = make_requests(40, seed=budget)
        outputs, _ = simulate(specs, num_pages=60, max_batch=4, max_tokens=budget)
        assert outputs == reference(specs)
