"""Page bookkeeping per request and per pool (pure Python, no torch).

Logical page i of a request covers token positions [i * page_size, (i + 1) * page_size). A request holds, per
pool, a `PageList`: the live physical pages and `first`, the logical index of the first live page.

Sliding pools free pages that left every future query's window. With W the window (key j visible to query i iff
i - W < j <= i) and L the number of tokens whose KV is cached, every future query has position >= L, so the
oldest key it can see is L - W + 1; the page holding it, (L - W + 1) // page_size, and everything after stay,
everything before is freed and `first` advances. A long sequence therefore holds at most
ceil((W - 1 + chunk) / page_size) + 1 sliding pages during a step. Page tables carry only live pages; attention
sees a kv of length (L + q) - first * page_size whose positions are shifted by first * page_size for queries and
keys alike, so causal and window masks (relative quantities) select the same keys as on the untrimmed sequence.

Page 0 of every pool is the reserved dummy page (CUDA-graph padding) and is never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from perfkit.runtime.kv_cache import DUMMY_PAGE


@dataclass
class PageList:
    pages: list[int] = field(default_factory=list)
    first: int = 0  # logical index of pages[0]; leading pages [0, first) were freed

    @property
    def end(self) -> int:
        """One past the last logical page covered."""
        return self.first + len(self.pages)


class BlockManager:
    def __init__(self, num_pages: dict[str, int], page_size: int, windows: dict[str, int | None]):
        self.page_size = page_size
        self.capacity = dict(num_pages)
        self.windows = dict(windows)
        self._free: dict[str, list[int]] = {
            p: [i for i in range(n - 1, -1, -1) if i != DUMMY_PAGE] for p, n in num_pages.items()
        }
        self.tables: dict[int, dict[str, PageList]] = {}

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def pools(self) -> list[str]:
        return list(self.capacity)

    def num_free(self, pool: str) -> int:
        return len(self._free[pool])

    def num_used(self, pool: str) -> int:
        return self.capacity[pool] - 1 - len(self._free[pool])

    def page_list(self, req_id: int, pool: str) -> PageList:
        return self.tables[req_id][pool]

    def keep_from(self, pool: str, num_cached: int) -> int:
        """First logical page any query at position >= num_cached can still see."""
        w = self.windows[pool]
        if w is None:
            return 0
        return max(0, num_cached - w + 1) // self.page_size

    def new_pages_needed(self, req_id: int, num_tokens: int) -> dict[str, int]:
        """Pages to add per pool so that logical tokens [0, num_tokens) are covered."""
        need_end = -(-num_tokens // self.page_size)
        tab = self.tables.get(req_id)
        return {p: max(0, need_end - (tab[p].end if tab else 0)) for p in self.capacity}

    def can_allocate(self, req_id: int, num_tokens: int) -> bool:
        need = self.new_pages_needed(req_id, num_tokens)
        return all(need[p] <= len(self._free[p]) for p in need)

    # ---- mutations -----------------------------------------------------------------------------------------
    def allocate(self, req_id: int, num_tokens: int) -> None:
        """Grow the request's page lists to cover [0, num_tokens). Raises if a pool is short (check first)."""
        need = self.new_pages_needed(req_id, num_tokens)
        if any(need[p] > len(self._free[p]) for p in need):
            raise RuntimeError(f"out of KV pages for request {req_id}: need {need}")
        tab = self.tables.setdefault(req_id, {p: PageList() for p in self.capacity})
        for p, n in need.items():
            if n:
                free = self._free[p]
                tab[p].pages.extend(free[-n:][::-1])
                del free[-n:]

    def trim(self, req_id: int, num_cached: int) -> int:
        """Free sliding pages that no query at position >= num_cached can see. Returns pages freed."""
        tab = self.tables.get(req_id)
        if tab is None:
            return 0
        freed = 0
        for p, pl in tab.items():
            n = min(self.keep_from(p, num_cached) - pl.first, len(pl.pages))
            if n > 0:
                self._free[p].extend(pl.pages[:n])
                del pl.pages[:n]
                pl.first += n
                freed += n
        return freed

    def free(self, req_id: int) -> None:
        tab = self.tables.pop(req_id, None)
        if tab is None:
            return
        for p, pl in tab.items():
            self._free[p].extend(pl.pages)

    def check_no_leaks(self) -> None:
        """Every non-dummy page is either free or owned by exactly one live request."""
        for p, cap in self.capacity.items():
            owned = [pg for tab in self.tables.values() for pg in tab[p].pages]
            everything = sorted(owned + self._free[p])
            if everything != list(range(1, cap)):
                raise AssertionError(f"pool {p}: page accounting broken ({len(everything)} of {cap - 1} pages)")
