"""Block manager invariants: no leaks, exact sliding-window page freeing, dummy page never handed out."""

import random

import pytest

from perfkit.runtime.block_manager import BlockManager
from perfkit.runtime.kv_cache import DUMMY_PAGE


def test_random_requests_no_leaks():
    rng = random.Random(0)
    bm = BlockManager({"sliding": 300, "full": 500}, page_size=4, windows={"sliding": 7, "full": None})
    live: dict[int, int] = {}  # req -> tokens cached
    next_id = 0
    for _ in range(20_000):
        op = rng.random()
        if (op < 0.05 or not live) and next_id < 1000:
            n = rng.randint(1, 30)
            if bm.can_allocate(next_id, n):
                bm.allocate(next_id, n)
                bm.trim(next_id, n)
                live[next_id] = n
            next_id += 1
        elif op < 0.15 and live:
            r = rng.choice(list(live))
            bm.free(r)
            del live[r]
        elif live:
            r = rng.choice(list(live))
            n = live[r] + rng.randint(1, 9)
            if bm.can_allocate(r, n):
                bm.allocate(r, n)
                bm.trim(r, n)
                live[r] = n
        bm.check_no_leaks()
        for r in live:
            for p in bm.pools:
                assert DUMMY_PAGE not in bm.page_list(r, p).pages
    for r in list(live):
        bm.free(r)
    bm.check_no_leaks()
    assert next_id == 1000
    assert bm.num_free("sliding") == 299 and bm.num_free("full") == 499


@pytest.mark.parametrize("window,ps", [(1, 4), (5, 4), (8, 4), (9, 4), (16, 16), (17, 16)])
def test_sliding_trim_keeps_exactly_the_visible_pages(window, ps):
    bm = BlockManager({"sliding": 1000, "full": 1000}, page_size=ps, windows={"sliding": window, "full": None})
    L = 0
    for step in range(200):
        q = 1 + (step * 7) % 11
        bm.allocate(0, L + q)
        pl = bm.page_list(0, "sliding")
        # every query of this step (positions L..L+q-1) must find all its visible keys in live pages
        oldest_needed = max(0, L - window + 1)
        assert pl.first * ps <= oldest_needed
        assert pl.end * ps >= L + q
        L += q
        bm.trim(0, L)
        pl = bm.page_list(0, "sliding")
        oldest_future = max(0, L - window + 1)
        assert pl.first == oldest_future // ps  # the page holding the oldest visible key stays, nothing older
        assert len(pl.pages) <= -(-(window - 1) // ps) + 2
        assert bm.page_list(0, "full").first == 0
        assert len(bm.page_list(0, "full").pages) == -(-L // ps)
    bm.free(0)
    bm.check_no_leaks()
