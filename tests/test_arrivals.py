"""Arrival processes: open-loop rate and burstiness statistics, closed-loop concurrency cap, limits."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from perfkit.config import AllAtOnce, ClosedLoop, OpenLoop, ScenarioConfig
from perfkit.errors import PerfkitError
from perfkit.workloads.arrivals import (
    AllAtOnceArrivals,
    ClosedLoopController,
    Limits,
    OpenLoopArrivals,
    arrival_offsets,
    make_arrival,
    planned_requests,
)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("rescale", [True, False])
def test_open_loop_rate_and_cv(burstiness, rescale):
    rate, n = 20.0, 2000
    off = arrival_offsets(rate, burstiness, n, seed=0, rescale=rescale)
    assert off.shape == (n,) and off[0] == 0.0 and (np.diff(off) >= 0).all()
    realised = (n - 1) / off[-1]
    assert abs(realised / rate - 1) < 0.05
    if rescale:
        assert realised == pytest.approx(rate, rel=1e-9)
    gaps = np.diff(off)
    cv = gaps.std() / gaps.mean()
    assert abs(cv - 1 / np.sqrt(burstiness)) < 0.08 / np.sqrt(burstiness)


def test_open_loop_seeded():
    a = arrival_offsets(5.0, 1.0, 100, seed=1)
    assert np.array_equal(a, arrival_offsets(5.0, 1.0, 100, seed=1))
    assert not np.array_equal(a, arrival_offsets(5.0, 1.0, 100, seed=2))
    arr = make_arrival(OpenLoop(rate=5.0), 100, seed=1)
    assert isinstance(arr, OpenLoopArrivals) and np.array_equal(arr.offsets, a)


def test_open_loop_due_and_next_time():
    arr = OpenLoopArrivals(np.array([0.0, 0.5, 0.5, 2.0]))
    assert arr.due(0.0, 0, 0) == 1
    assert arr.next_time_s(0.1, 1, 1) == 0.5
    assert arr.due(0.49, 5, 1) == 0
    assert arr.due(0.5, 5, 1) == 2  # in_flight does not throttle an open loop
    assert arr.due(10.0, 0, 3) == 1
    assert arr.next_time_s(10.0, 0, 3) == 10.0  # overdue: now
    assert arr.next_time_s(10.0, 0, 4) is None


def simulate(arrival, n: int, service: np.ndarray) -> tuple[int, np.ndarray]:
    """Discrete-event run of an arrival process with the given service times; returns (max in flight, submit
    times)."""
    now, in_flight, submitted, peak = 0.0, 0, 0, 0
    finishes: list[float] = []
    submit_times = []
    while submitted < n or finishes:
        k = min(arrival.due(now, in_flight, submitted), n - submitted)
        for _ in range(k):
            heapq.heappush(finishes, now + service[submitted])
            submit_times.append(now)
            submitted += 1
            in_flight += 1
        peak = max(peak, in_flight)
        nxt = arrival.next_time_s(now, in_flight, submitted) if submitted < n else None
        if finishes and (nxt is None or finishes[0] <= nxt):
            now = heapq.heappop(finishes)
            in_flight -= 1
        elif nxt is not None:
            now = max(now, nxt)
        else:
            break
    return peak, np.array(submit_times)


@pytest.mark.parametrize("concurrency", [1, 3, 16])
def test_closed_loop_never_exceeds_concurrency(concurrency):
    rng = np.random.default_rng(concurrency)
    service = rng.exponential(1.0, size=500)
    peak, submits = simulate(ClosedLoopController(concurrency, 500), 500, service)
    assert peak == concurrency
    assert len(submits) == 500 and (submits[:concurrency] == 0).all()


def test_closed_loop_event_form():
    rng = np.random.default_rng(0)
    c, n = 4, 200
    ctl = ClosedLoopController(c, n)
    finishes: list[float] = []
    sid = 0

    def submit(k, now):
        nonlocal sid
        for _ in range(k):
            heapq.heappush(finishes, now + rng.exponential())
            sid += 1

    submit(ctl.initial(), 0.0)
    assert ctl.in_flight == c == len(finishes)
    while finishes:
        now = heapq.heappop(finishes)
        submit(ctl.on_finish(), now)
        assert len(finishes) <= c and ctl.in_flight == len(finishes)
    assert sid == n and ctl.submitted == n and ctl.in_flight == 0
    with pytest.raises(RuntimeError):
        ctl.on_finish()
    small = ClosedLoopController(8, 3)
    assert small.initial() == 3  # fewer requests than the concurrency


def test_closed_loop_unbounded_and_next_time():
    ctl = ClosedLoopController(2)
    assert ctl.due(0.0, 0, 10_000) == 2
    assert ctl.next_time_s(1.0, 2, 5) is None  # at the cap: only a completion helps
    assert ctl.next_time_s(1.0, 1, 5) == 1.0


def test_all_at_once():
    arr = make_arrival(AllAtOnce(), 7, seed=0)
    assert isinstance(arr, AllAtOnceArrivals)
    assert arr.due(0.0, 0, 0) == 7 and arr.due(0.0, 7, 7) == 0
    assert arr.next_time_s(0.0, 7, 7) is None
    peak, submits = simulate(arr, 7, np.ones(7))
    assert peak == 7 and (submits == 0).all()


def test_open_loop_simulated_rate():
    arr = make_arrival(OpenLoop(rate=50.0, burstiness=0.5), 2000, seed=3)
    _, submits = simulate(arr, 2000, np.full(2000, 0.2))
    assert np.allclose(submits, arr.offsets)  # type: ignore[attr-defined]
    assert (2000 - 1) / submits[-1] == pytest.approx(50.0)


def test_make_arrival_dispatch_and_errors():
    assert isinstance(make_arrival(ClosedLoop(concurrency=2), None), ClosedLoopController)
    with pytest.raises(PerfkitError, match="needs a request count"):
        make_arrival(OpenLoop(rate=1.0), None)
    with pytest.raises(ValueError):
        arrival_offsets(0.0, 1.0, 10)
    assert arrival_offsets(1.0, 1.0, 0).shape == (0,)
    assert arrival_offsets(1.0, 1.0, 1).tolist() == [0.0]


def scenario(**kw) -> ScenarioConfig:
    return ScenarioConfig.model_validate({"name": "s", "workload": {"isl": 8, "osl": 8}, **kw})


def test_limits_and_planned_requests():
    lim = Limits.from_scenario(scenario(num_requests=10, duration_s=5.0))
    assert lim.may_submit(9, 4.9) and not lim.may_submit(10, 0.0) and not lim.may_submit(0, 5.0)
    assert lim.clamp(4, 8, 1.0) == 2 and lim.clamp(4, 0, 6.0) == 0
    assert planned_requests(scenario(num_requests=10, duration_s=5.0)) == 10
    assert planned_requests(scenario(duration_s=10.0, arrival={"kind": "rate", "rate": 2.5})) == 25
    assert planned_requests(scenario(duration_s=10.0, arrival={"kind": "closed", "concurrency": 4})) is None
    with pytest.raises(ValueError, match="all_at_once needs num_requests"):  # the config refuses it already
        scenario(duration_s=10.0, arrival={"kind": "all_at_once"})
    # open loop sized from the duration: every planned arrival lands inside it
    sc = scenario(duration_s=10.0, arrival={"kind": "rate", "rate": 2.5, "burstiness": 0.3})
    off = make_arrival(sc.arrival, planned_requests(sc), seed=0).offsets  # type: ignore[attr-defined]
    assert off[-1] < 10.0
