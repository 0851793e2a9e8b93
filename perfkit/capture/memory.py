"""Peak CUDA memory per phase, from the caching allocator's own counters.

    mem = MemoryTracker()                       # on CPU: mem.section() -> available=False, "no CUDA device"
    with mem.phase("weights_load"): model = build_model(...)
    with mem.phase("kv_pool"): cache = ...
    mem.set_kv_pool_bytes(cache.nbytes)         # optional; else the phase's allocated delta is used
    with mem.phase("warmup"): ...
    with mem.phase(f"scenario:{name}"):         # starts a new scenario scope (drops the last one's sub-phases)
        ... with mem.phase("build_mask"): ...   # sub-phases nest; repeated ones are sampled (see below)
    scenario_result.memory = mem.section()

A phase resets the allocator's peak statistics at its boundaries and records the peak allocated / reserved
bytes seen inside it; nested phases fold their peaks into every enclosing phase, so an outer phase's peak is
still the true maximum over its whole duration. Repeated phases (a sub-phase entered every step) keep the
maximum over the occurrences measured: the first `sample_first` of each name per scenario, then every
`sample_stride`-th (reading the allocator statistics costs tens of microseconds, too much for every step).
The allocator counters are host-side bookkeeping: nothing here synchronizes the device.

`alloc_retries` (`num_alloc_retries`: cudaMalloc failed, cache flushed, retried) and `num_ooms` are counted
from the start of the current `scenario:` phase (or the tracker's creation when none has started).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from perfkit.results import MemorySection, PhaseMemory

SCENARIO_PREFIX = "scenario:"
SETUP_PHASES = ("weights_load", "kv_pool", "warmup")


@dataclass
class _Frame:
    name: str
    start_allocated: int
    peak_allocated: int
    peak_reserved: int
    scoped: bool


class MemoryTracker:
    """Per-phase peak CUDA memory. `cuda` is injectable (anything with torch.cuda's memory functions)."""

    def __init__(
        self,
        enabled: bool = True,
        device: Any = None,
        cuda: Any = None,
        sample_first: int = 8,
        sample_stride: int = 64,
    ):
        self.device = device
        self.sample_first = sample_first
        self.sample_stride = max(1, sample_stride)
        self.reason: str | None = None
        self._cuda = cuda
        if not enabled:
            self.reason = "memory capture off"
        else:
            if self._cuda is None:
                import torch

                self._cuda = torch.cuda
            if not self._cuda.is_available():
                self.reason = "no CUDA device"
        self.available = self.reason is None
        self._stack: list[_Frame] = []
        self._setup: dict[str, PhaseMemory] = {}
        self._scoped: dict[str, PhaseMemory] = {}
        self._occurrences: dict[str, int] = {}
        self._weights_bytes: int | None = None
        self._kv_pool_bytes: int | None = None
        self._explicit: set[str] = set()
        self._base_retries = 0
        self._base_ooms = 0
        if self.available:
            self._base_retries, self._base_ooms = self._counters()

    # ---- allocator reads ----------------------------------------------------------------------------------------
    def _counters(self) -> tuple[int, int]:
        stats = self._cuda.memory_stats(self.device)
        return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0))

    def _peaks(self) -> tuple[int, int]:
        return (
            int(self._cuda.max_memory_allocated(self.device)),
            int(self._cuda.max_memory_reserved(self.device)),
        )

    def _fold(self) -> None:
        """Fold the allocator's current peaks into every open phase."""
        if not self._stack:
            return
        pa, pr = self._peaks()
        for f in self._stack:
            f.peak_allocated = max(f.peak_allocated, pa)
            f.peak_reserved = max(f.peak_reserved, pr)

    def _should_sample(self, name: str) -> bool:
        if name.startswith(SCENARIO_PREFIX) or name in SETUP_PHASES:
            return True
        n = self._occurrences.get(name, 0)
        self._occurrences[name] = n + 1
        return n < self.sample_first or (n - self.sample_first) % self.sample_stride == self.sample_stride - 1

    # ---- API ------------------------------------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure peak allocated / reserved bytes inside the block (no-op when unavailable or not sampled)."""
        if not self.available or not self._should_sample(name):
            yield
            return
        if name.startswith(SCENARIO_PREFIX):
            self._scoped.clear()
            self._occurrences.clear()
            self._base_retries, self._base_ooms = self._counters()
        self._fold()
        self._cuda.reset_peak_memory_stats(self.device)
        pa, pr = self._peaks()
        scoped = name.startswith(SCENARIO_PREFIX) or any(f.scoped for f in self._stack)
        frame = _Frame(name, int(self._cuda.memory_allocated(self.device)), pa, pr, scoped)
        self._stack.append(frame)
        try:
            yield
        finally:
            self._fold()
            self._stack.pop()
            self._cuda.reset_peak_memory_stats(self.device)
            self._record(frame)

    def _record(self, f: _Frame) -> None:
        table = self._scoped if f.scoped else self._setup
        old = table.get(f.name)
        if old is not None:
            f.peak_allocated = max(f.peak_allocated, old.peak_allocated_bytes)
            f.peak_reserved = max(f.peak_reserved, old.peak_reserved_bytes)
        table[f.name] = PhaseMemory(peak_allocated_bytes=f.peak_allocated, peak_reserved_bytes=f.peak_reserved)
        delta = int(self._cuda.memory_allocated(self.device)) - f.start_allocated
        if f.name == "weights_load" and "weights" not in self._explicit:
            self._weights_bytes = delta
        elif f.name == "kv_pool" and "kv" not in self._explicit:
            self._kv_pool_bytes = delta

    def set_weights_bytes(self, n: int) -> None:
        """Exact weight bytes (sum of parameter nbytes); overrides the weights_load allocated delta."""
        self._weights_bytes = int(n)
        self._explicit.add("weights")

    def set_kv_pool_bytes(self, n: int) -> None:
        """Exact KV pool bytes; overrides the kv_pool allocated delta."""
        self._kv_pool_bytes = int(n)
        self._explicit.add("kv")

    def section(self) -> MemorySection:
        """Setup phases + the current (or last) scenario's phases, weights / KV bytes, retries and OOMs."""
        if not self.available:
            return MemorySection(available=False, reason=self.reason)
        retries, ooms = self._counters()
        return MemorySection(
            available=True,
            phases={**self._setup, **self._scoped},
            weights_bytes=self._weights_bytes,
            kv_pool_bytes=self._kv_pool_bytes,
            alloc_retries=retries - self._base_retries,
            num_ooms=ooms - self._base_ooms,
        )
