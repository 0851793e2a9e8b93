"""RangeRecorder: nesting, counting, fake clock, fake CUDA events, disabled path."""

from __future__ import annotations

import pytest

from perfkit.capture.ranges import NULL_RECORDER, RangeRecorder, overhead_benchmark, percentile
from perfkit.results import RangeStats


class FakeClock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t

    def advance_ms(self, ms: float) -> None:
        self.t += int(ms * 1_000_000)


class FakeDomain:
    """Records NVTX calls; attributes are just the message."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.attr_requests = 0

    def get_event_attributes(self, message: str | None = None) -> str | None:
        self.attr_requests += 1
        return message

    def push_range(self, attributes: str | None = None) -> None:
        self.calls.append(("push", attributes))

    def pop_range(self) -> None:
        self.calls.append(("pop", None))


class FakeEvent:
    """A CUDA event whose timestamp is the fake clock's value when recorded."""

    def __init__(self, clock: FakeClock, log: list[str]) -> None:
        self.clock = clock
        self.t: int | None = None
        self.log = log

    def record(self, stream: object = None) -> None:
        self.t = self.clock.t
        self.log.append("record")

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) / 1e6


def make(device: bool = False, pool: int = 16, max_events: int = 1 << 20):
    clock, dom, log = FakeClock(), FakeDomain(), []
    syncs: list[int] = []
    rec = RangeRecorder(
        clock=clock,
        nvtx_domain=dom,
        device_timing=device,
        event_factory=lambda: FakeEvent(clock, log),
        synchronize=lambda: syncs.append(1),
        event_pool_size=pool,
        max_events=max_events,
    )
    return rec, clock, dom, log, syncs


def test_nesting_and_counting_with_fake_clock():
    rec, clock, dom, _, _ = make()
    for _ in range(3):
        with rec.range("step"):
            with rec.range("schedule"):
                clock.advance_ms(1)
            with rec.range("forward_decode"):
                clock.advance_ms(10)
            clock.advance_ms(2)
    s = rec.summary()
    assert set(s) == {"step", "schedule", "forward_decode"}
    assert all(isinstance(v, RangeStats) for v in s.values())
    assert s["step"].count == 3 and s["schedule"].count == 3 and s["forward_decode"].count == 3
    assert s["step"].host_total_ms == pytest.approx(39.0)
    assert s["step"].host_mean_ms == pytest.approx(13.0)
    assert s["schedule"].host_p50_ms == pytest.approx(1.0)
    assert s["forward_decode"].host_p99_ms == pytest.approx(10.0)
    assert s["step"].device_total_ms is None
    # NVTX: balanced push/pop in nesting order, attributes created once per name
    assert dom.calls[:6] == [
        ("push", "step"),
        ("push", "schedule"),
        ("pop", None),
        ("push", "forward_decode"),
        ("pop", None),
        ("pop", None),
    ]
    assert len(dom.calls) == 18
    assert dom.attr_requests == 3
    assert rec.open_ranges == []


def test_same_name_nested_and_exception_pops():
    rec, clock, dom, _, _ = make()
    with rec.range("a"):
        clock.advance_ms(1)
        with rec.range("a"):
            clock.advance_ms(2)
    with pytest.raises(ValueError):
        with rec.range("b"):
            clock.advance_ms(5)
            raise ValueError("boom")
    s = rec.summary()
    assert s["a"].count == 2
    assert s["a"].host_p50_ms == pytest.approx(2.5)  # durations 2 and 3
    assert s["a"].host_total_ms == pytest.approx(5.0)
    assert s["b"].count == 1 and s["b"].host_total_ms == pytest.approx(5.0)
    assert rec.open_ranges == []
    assert [c[0] for c in dom.calls].count("push") == [c[0] for c in dom.calls].count("pop") == 3


def test_percentiles_linear():
    vals = [float(x) for x in range(1, 101)]
    assert percentile(vals, 50) == pytest.approx(50.5)
    assert percentile(vals, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0


def test_device_timing_resolved_only_in_summary():
    rec, clock, _, log, syncs = make(device=True, pool=4)
    assert log.count("record") == 0  # fake factory does not pre-record
    for _ in range(5):
        with rec.range("step"):
            clock.advance_ms(1)
            with rec.range("forward_decode"):
                clock.advance_ms(3)
    assert syncs == []  # no sync in the loop
    assert log.count("record") == 20  # 2 per occurrence, pool grew from 4
    s = rec.summary()
    assert syncs == [1]
    assert s["step"].device_total_ms == pytest.approx(20.0)
    assert s["forward_decode"].device_mean_ms == pytest.approx(3.0)
    assert s["forward_decode"].device_p99_ms == pytest.approx(3.0)
    # reset returns events to the pool: no new events needed for the same amount of work
    pool_size = len(rec._pool)
    rec.reset()
    assert rec.summary() == {}
    with rec.range("step"):
        clock.advance_ms(1)
    assert len(rec._pool) == pool_size
    assert rec.summary()["step"].device_total_ms == pytest.approx(1.0)


def test_graph_capture_suspends_device_events():
    rec, clock, _, log, _ = make(device=True)
    with rec.range("graph_capture"):
        with rec.range("forward_decode"):
            clock.advance_ms(2)
    assert log.count("record") == 0
    with rec.range("forward_decode"):
        clock.advance_ms(1)
    assert log.count("record") == 2
    s = rec.summary()
    assert s["graph_capture"].count == 1 and s["graph_capture"].device_total_ms is None
    assert s["forward_decode"].count == 2
    assert s["forward_decode"].device_total_ms == pytest.approx(1.0)  # only the occurrence outside capture


def test_event_pool_cap_falls_back_to_host_only():
    rec, clock, _, _, _ = make(device=True, pool=2, max_events=4)
    for _ in range(3):
        with rec.range("x"):
            clock.advance_ms(1)
    s = rec.summary()
    assert s["x"].count == 3
    assert s["x"].device_total_ms == pytest.approx(2.0)  # two occurrences had events
    assert rec.dropped_device == 1


def test_disabled_recorder_is_a_noop():
    calls = []
    rec = RangeRecorder(enabled=False, clock=lambda: calls.append(1) or 0)
    ctx1, ctx2 = rec.range("step"), rec.range("forward_decode")
    assert ctx1 is ctx2  # one shared no-op object
    with rec.range("step"):
        pass
    assert calls == []
    assert rec.summary() == {}
    with NULL_RECORDER.range("anything"):
        pass
    assert NULL_RECORDER.summary() == {}


def test_reset_with_open_range_raises():
    rec, _, _, _, _ = make()
    cm = rec.range("step")
    cm.__enter__()
    with pytest.raises(RuntimeError):
        rec.reset()
    cm.__exit__(None, None, None)
    rec.reset()


def test_real_nvtx_package_smoke():
    rec = RangeRecorder()  # real nvtx domain "perfkit" (a no-op without a profiler attached)
    with rec.range("step"):
        with rec.range("sample"):
            pass
    assert rec.summary()["sample"].count == 1


def test_overhead_benchmark_runs_on_cpu():
    r = overhead_benchmark(n_iters=200, ranges_per_step=5, device_timing=False)
    assert r["ranges_per_step"] == 5
    assert r["enabled_us_per_step"] > 0 and r["disabled_us_per_step"] > 0


def test_device_ranges_filter():
    clock, log = FakeClock(), []
    rec = RangeRecorder(
        clock=clock,
        nvtx_domain=FakeDomain(),
        device_timing=True,
        device_ranges={"forward_decode"},
        event_factory=lambda: FakeEvent(clock, log),
        synchronize=lambda: None,
    )
    with rec.range("forward_decode"):
        with rec.range("layer_000"):
            clock.advance_ms(1)
    assert log.count("record") == 2
    s = rec.summary()
    assert s["layer_000"].count == 1 and s["layer_000"].device_total_ms is None
    assert s["forward_decode"].device_total_ms == pytest.approx(1.0)


def test_device_every_samples_events():
    clock, log = FakeClock(), []
    rec = RangeRecorder(
        clock=clock,
        nvtx_domain=FakeDomain(),
        device_timing=True,
        device_every=4,
        event_factory=lambda: FakeEvent(clock, log),
        synchronize=lambda: None,
    )
    for i in range(10):
        with rec.range("forward_decode"):
            clock.advance_ms(i)
    assert log.count("record") == 6  # occurrences 0, 4, 8
    s = rec.summary()["forward_decode"]
    assert s.count == 10 and s.host_total_ms == pytest.approx(45.0)
    assert s.device_total_ms == pytest.approx(0 + 4 + 8)
