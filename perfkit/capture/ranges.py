"""NVTX ranges with in-process host timings and (optional) CUDA-event device timings.

The engine wraps each phase of a step::

    rec = RangeRecorder(device_timing=torch.cuda.is_available())
    with rec.range("step"):
        with rec.range("schedule"):
            ...
        with rec.range("forward_decode"):
            ...
    nvtx_section = rec.summary()       # after the scenario: {name: RangeStats}; rec.reset() before the next

Each range pushes/pops an NVTX range in the "perfkit" domain (visible in Nsight Systems), times its host
duration with `perf_counter_ns`, and, with device timing on, records a CUDA event at push and at pop on the
current stream. Events come from a pool created up front and are resolved (one synchronize, then
`elapsed_time`) only in `summary()`: the hot loop never syncs. Device time is the time between the two events
on the stream, so it includes GPU idle gaps inside the range (a host-bound range shows them).

A disabled recorder (`RangeRecorder(enabled=False)` or `NULL_RECORDER`) returns one shared no-op context.
Ranges named in `host_only` (default: `graph_capture`) never record events, and no events are recorded while
one of them is open: recording a timing event on a capturing stream is not allowed.

Overhead, measured on the H200 machine (torch 2.11, no profiler attached), per range occurrence: disabled
~0.2 us, NVTX + host timing ~1 us, plus ~2 us per CUDA event record (two per timed occurrence; the stream is
looked up once, since `torch.cuda.current_stream()` alone costs ~4 us). Ten ranges per step: ~10 us host-only,
~26 us with `device_ranges=DEVICE_RANGES`, ~45 us with events on every range. Re-measure with
`overhead_benchmark()`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from perfkit.results import RangeStats

ENGINE_PHASES = (
    "step",
    "schedule",
    "prepare_inputs",
    "build_mask",
    "mm_encode",
    "forward_prefill",
    "forward_decode",
    "sample",
    "resolve",
    "postprocess",
    "graph_capture",
)
# The phases whose GPU time matters: pass as `device_ranges=` to keep event records (~2 us each) off the
# host-only phases.
DEVICE_RANGES = ("step", "build_mask", "mm_encode", "forward_prefill", "forward_decode")
NVTX_DOMAIN = "perfkit"


def layer_range_name(i: int) -> str:
    """Name of the optional per-layer range (precompute these once; do not format names in the hot loop)."""
    return f"layer_{i:03d}"


class _NullRange:
    """Shared no-op context: what a disabled recorder hands out."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_RANGE = _NullRange()


class _Range:
    """Cached per-name context object; the state of an open range lives on the recorder's stack."""

    __slots__ = ("_rec", "_name")

    def __init__(self, rec: RangeRecorder, name: str):
        self._rec = rec
        self._name = name

    def __enter__(self) -> None:
        self._rec.push(self._name)

    def __exit__(self, *exc: object) -> None:
        self._rec.pop()


class _NvtxOff:
    """Stands in for an nvtx Domain when NVTX is off."""

    def get_event_attributes(self, message: str | None = None) -> None:
        return None

    def push_range(self, attributes: Any = None) -> None:
        return None

    def pop_range(self) -> None:
        return None


class RangeRecorder:
    """Named, nestable ranges: NVTX push/pop + host ns timings + optional CUDA-event device timings.

    Args:
        enabled: False -> every `range()` is the shared no-op context (no NVTX, no timing).
        nvtx: emit NVTX ranges (domain "perfkit"); the nvtx package turns them into no-ops without a profiler.
        device_timing: record CUDA events at push/pop (needs CUDA); resolved in `summary()`.
        clock: host clock returning integer nanoseconds (tests inject a fake).
        event_pool_size: CUDA events created up front (2 per range occurrence); the pool grows by this many when
            exhausted, up to `max_events`, after which further occurrences are timed on the host only.
        host_only: range names that never record events and suspend device timing while open.
        device_ranges: when given, only these names record events (e.g. leave per-layer ranges NVTX + host only:
            an event record costs a few microseconds of host time).
        device_every: record events for every n-th occurrence of each name only (1 = all); device stats are then
            over that sample (`count` stays the number of occurrences; host timings cover all of them).
        event_factory: makes one timing event (tests); default `torch.cuda.Event(enable_timing=True)`.
        nvtx_domain: an object with get_event_attributes/push_range/pop_range (tests); default the nvtx package.
        stream: the CUDA stream events are recorded on; default the current stream at the first record (asking
            torch for the current stream costs ~4 us, so it is looked up once). An engine that moves its work to
            another stream calls `set_stream()`.
    """

    def __init__(
        self,
        enabled: bool = True,
        *,
        nvtx: bool = True,
        device_timing: bool = False,
        clock: Callable[[], int] = time.perf_counter_ns,
        event_pool_size: int = 4096,
        max_events: int = 1 << 20,
        host_only: Iterable[str] = ("graph_capture",),
        device_ranges: Iterable[str] | None = None,
        device_every: int = 1,
        event_factory: Callable[[], Any] | None = None,
        nvtx_domain: Any = None,
        synchronize: Callable[[], None] | None = None,
        stream: Any = None,
    ):
        self.enabled = enabled
        self.device_timing = bool(device_timing and enabled)
        self._clock = clock
        self._host_only = frozenset(host_only)
        self._device_names = None if device_ranges is None else frozenset(device_ranges)
        self._device_every = max(1, int(device_every))
        self._device_seen: dict[str, int] = {}
        self._ranges: dict[str, _Range] = {}
        self._attrs: dict[str, Any] = {}
        self._stack: list[tuple[str, int, int]] = []  # (name, t0_ns, start event index or -1)
        self._host_ns: dict[str, list[int]] = {}
        self._event_pairs: dict[str, list[tuple[int, int]]] = {}
        self._suspend = 0
        self.dropped_device = 0  # occurrences timed on host only because the pool hit max_events
        self._pool: list[Any] = []
        self._cursor = 0
        self._pool_chunk = max(2, event_pool_size)
        self._max_events = max_events
        self._event_factory = event_factory
        self._synchronize = synchronize
        self._stream = stream
        self._current_stream: Callable[[], Any] | None = None
        if not enabled:
            self.range = self._null_range  # type: ignore[method-assign]
            self._domain: Any = _NvtxOff()
            return
        if nvtx_domain is not None:
            self._domain = nvtx_domain
        elif nvtx:
            import nvtx as _nvtx

            self._domain = _nvtx.get_domain(NVTX_DOMAIN)
        else:
            self._domain = _NvtxOff()
        if self.device_timing:
            if self._event_factory is None:
                import torch

                def _make() -> Any:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()  # torch creates the CUDA event lazily: do it now, not in the hot loop
                    return ev

                self._event_factory = _make
                self._synchronize = self._synchronize or torch.cuda.synchronize
                self._current_stream = torch.cuda.current_stream
            self._grow_pool()

    # ---- hot path -----------------------------------------------------------------------------------------------
    def range(self, name: str) -> Any:
        """Context manager for one occurrence of range `name` (objects cached per name)."""
        r = self._ranges.get(name)
        if r is None:
            r = self._ranges[name] = _Range(self, name)
        return r

    def _null_range(self, name: str) -> Any:
        return _NULL_RANGE

    def push(self, name: str) -> None:
        attrs = self._attrs.get(name)
        if attrs is None:
            attrs = self._attrs[name] = self._domain.get_event_attributes(message=name)
        self._domain.push_range(attrs)
        ev = -1
        if self.device_timing:
            if name in self._host_only:
                self._suspend += 1
            elif not self._suspend and (self._device_names is None or name in self._device_names):
                if self._device_every == 1:
                    ev = self._record_event()
                else:
                    k = self._device_seen.get(name, 0)
                    self._device_seen[name] = k + 1
                    if k % self._device_every == 0:
                        ev = self._record_event()
        self._stack.append((name, self._clock(), ev))

    def pop(self) -> None:
        t1 = self._clock()
        name, t0, ev0 = self._stack.pop()
        if ev0 >= 0:
            ev1 = self._record_event()
            if ev1 >= 0:
                pairs = self._event_pairs.get(name)
                if pairs is None:
                    pairs = self._event_pairs[name] = []
                pairs.append((ev0, ev1))
        elif self.device_timing and name in self._host_only:
            self._suspend -= 1
        self._domain.pop_range()
        lst = self._host_ns.get(name)
        if lst is None:
            lst = self._host_ns[name] = []
        lst.append(t1 - t0)

    def _record_event(self) -> int:
        i = self._cursor
        if i >= len(self._pool) and not self._grow_pool():
            self.dropped_device += 1
            return -1
        if self._stream is None and self._current_stream is not None:
            self._stream = self._current_stream()
        self._pool[i].record(self._stream)
        self._cursor = i + 1
        return i

    def set_stream(self, stream: Any) -> None:
        """Record later events on `stream` (the stream the timed work runs on)."""
        self._stream = stream

    def _grow_pool(self) -> bool:
        n = min(self._pool_chunk, self._max_events - len(self._pool))
        if n <= 0:
            return False
        assert self._event_factory is not None
        self._pool.extend(self._event_factory() for _ in range(n))
        return True

    # ---- after the scenario -------------------------------------------------------------------------------------
    @property
    def open_ranges(self) -> list[str]:
        return [s[0] for s in self._stack]

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self._host_ns.items()}

    def summary(self) -> dict[str, RangeStats]:
        """Per range: count, host total/mean/p50/p99 ms and, with device timing, the same from CUDA events.

        Synchronizes the device once (when events were recorded). Does not clear; call `reset()` for that."""
        device_ms: dict[str, list[float]] = {}
        if self._event_pairs:
            if self._synchronize is not None:
                self._synchronize()
            pool = self._pool
            for name, pairs in self._event_pairs.items():
                device_ms[name] = [float(pool[a].elapsed_time(pool[b])) for a, b in pairs]
        out: dict[str, RangeStats] = {}
        for name, ns in self._host_ns.items():
            host = [x / 1e6 for x in ns]
            fields: dict[str, Any] = dict(
                count=len(host),
                host_total_ms=math.fsum(host),
                host_mean_ms=math.fsum(host) / len(host),
                host_p50_ms=percentile(host, 50.0),
                host_p99_ms=percentile(host, 99.0),
            )
            dev = device_ms.get(name)
            if dev:
                fields.update(
                    device_total_ms=math.fsum(dev),
                    device_mean_ms=math.fsum(dev) / len(dev),
                    device_p50_ms=percentile(dev, 50.0),
                    device_p99_ms=percentile(dev, 99.0),
                )
            out[name] = RangeStats(**fields)
        return out

    def reset(self) -> None:
        """Forget recorded occurrences and return every event to the pool (call between scenarios)."""
        if self._stack:
            raise RuntimeError(f"reset() with open ranges: {self.open_ranges}")
        self._host_ns.clear()
        self._event_pairs.clear()
        self._cursor = 0
        self._device_seen.clear()
        self.dropped_device = 0


NULL_RECORDER = RangeRecorder(enabled=False)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of a non-empty list."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def overhead_benchmark(
    n_iters: int = 5_000,
    ranges_per_step: int = 10,
    device_timing: bool | None = None,
    nvtx: bool = True,
    step_fn: Callable[[], Any] | None = None,
    device_every: int = 1,
    device_ranges: Iterable[str] | None = None,
) -> dict[str, float]:
    """Cost of the recorder per step, in microseconds, for `ranges_per_step` ranges (1 outer + the rest nested).

    Runs the same loop with a disabled recorder and an enabled one (NVTX on, device timing on when CUDA is
    present unless told otherwise) and reports host µs per step for each and their difference. `step_fn`, when
    given, runs inside the innermost range each step (e.g. a tiny CUDA kernel launch, so event records land on a
    busy stream). Divide `overhead_us_per_step` by the measured decode step time for the overhead fraction; on
    the H200 run e.g. `python -c "from perfkit.capture.ranges import overhead_benchmark as b; print(b())"`, and
    once under `nsys profile` to include the cost of an attached NVTX tool.
    """
    if device_timing is None:
        try:
            import torch

            device_timing = bool(torch.cuda.is_available())
        except ImportError:  # pragma: no cover - torch is a dependency
            device_timing = False
    names = [ENGINE_PHASES[i % len(ENGINE_PHASES)] if i else "step" for i in range(ranges_per_step)]
    names = [n if n != "graph_capture" else "postprocess" for n in names]
    inner = names[1:]
    fn = step_fn or (lambda: None)

    def loop(rec: RangeRecorder) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n_iters):
            with rec.range("step"):
                for name in inner:
                    with rec.range(name):
                        pass
                fn()
        return (time.perf_counter_ns() - t0) / 1e3 / n_iters

    off = RangeRecorder(enabled=False)
    on = RangeRecorder(
        nvtx=nvtx,
        device_timing=device_timing,
        device_every=device_every,
        device_ranges=device_ranges,
        event_pool_size=2 * n_iters * ranges_per_step // device_every + 2,
    )
    loop(off)  # warm-up
    base_us = min(loop(off) for _ in range(3))
    on_us = []
    for _ in range(3):
        on.reset()
        on_us.append(loop(on))
    t0 = time.perf_counter_ns()
    on.summary()
    summary_ms = (time.perf_counter_ns() - t0) / 1e6
    best = min(on_us)
    return {
        "ranges_per_step": float(ranges_per_step),
        "disabled_us_per_step": base_us,
        "enabled_us_per_step": best,
        "overhead_us_per_step": best - base_us,
        "overhead_us_per_range": (best - base_us) / ranges_per_step,
        "device_timing": float(bool(device_timing)),
        "summary_ms": summary_ms,
    }
