"""Arrival processes: when the runner may submit the next request.

Every process answers one question, without a clock of its own: given the time since the scenario started,
how many requests are in flight and how many were submitted, how many more may be submitted now?

    arrival = make_arrival(scenario.arrival, n, seed)      # n: from planned_requests(scenario); None = unbounded
    limits = Limits.from_scenario(scenario)
    t0 = perf_counter()
    while True:
        now = perf_counter() - t0
        k = arrival.due(now, in_flight, submitted)
        k = limits.clamp(k, submitted, now)                 # num_requests / duration_s
        submit k requests; submitted += k; in_flight += k
        if in_flight: step the engine (in_flight -= finished)
        else:
            t = arrival.next_time_s(now, in_flight, submitted)
            if t is None or not limits.may_submit(submitted, t): break     # nothing will ever be due
            sleep(t - now)

- closed loop (`ClosedLoopController`): due = C - in_flight (never more than C in flight); a new request
  becomes due only when one finishes, so `next_time_s` is None while at the cap. It also offers the event
  form `initial()` / `on_finish()` for runners driven by completions.
- open loop (`OpenLoopArrivals`): precomputed, seeded offsets; due = offsets <= now not yet submitted,
  regardless of in_flight (queueing inside the engine is measured, not avoided).
- all at once (`AllAtOnceArrivals`): everything due at t=0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from perfkit.config import AllAtOnce, ClosedLoop, OpenLoop, ScenarioConfig
from perfkit.errors import PerfkitError

_ARRIVAL_STREAM = 0xA221  # decorrelates arrival draws from request draws made with the same seed


def arrival_offsets(rate: float, burstiness: float, n: int, seed: int = 0, *, rescale: bool = True) -> np.ndarray:
    """Seconds from the start at which each of `n` requests arrives (float64, non-decreasing, first = 0).

    Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)) as in vLLM bench: mean 1/rate,
    CV 1/sqrt(burstiness) (1.0 = Poisson, < 1 burstier, > 1 smoother). With `rescale` the offsets are scaled so
    the last arrival is exactly at (n-1)/rate: the realised rate is exact for every seed (vLLM rescales the
    same way, but also delays the first request by one gap; here the first arrives at t=0).
    """
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive finite number (got {rate})")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    if n <= 0:
        return np.zeros(0)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) % (1 << 64), _ARRIVAL_STREAM]))
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    offsets = np.concatenate([[0.0], np.cumsum(gaps)])
    if rescale and n > 1 and offsets[-1] > 0:
        offsets *= ((n - 1) / rate) / offsets[-1]
    return offsets


class ArrivalProcess:
    """Interface the runner calls; see the module docstring for the loop."""

    num_requests: int | None = None  # None: unbounded (the runner's duration limit stops it)

    def remaining(self, submitted: int) -> int | float:
        return math.inf if self.num_requests is None else max(0, self.num_requests - submitted)

    def due(self, now_s: float, in_flight: int, submitted: int) -> int:
        """How many requests may be submitted now (>= 0)."""
        raise NotImplementedError

    def next_time_s(self, now_s: float, in_flight: int, submitted: int) -> float | None:
        """Earliest time (seconds since start, >= now_s) at which `due` becomes positive without any request
        finishing; None when only a completion can make one due, or when every request was submitted."""
        raise NotImplementedError


class ClosedLoopController(ArrivalProcess):
    """Fixed concurrency C: submit C at t=0, then one more each time one finishes. Never more than C in flight.

    Two equivalent forms: stateless `due(now_s, in_flight, submitted)`, or the event form `initial()` then
    `on_finish()` per completed request, each returning how many to submit now (the controller counts).
    """

    def __init__(self, concurrency: int, num_requests: int | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
        self.concurrency = concurrency
        self.num_requests = num_requests
        self.in_flight = 0
        self.submitted = 0

    def due(self, now_s: float, in_flight: int, submitted: int) -> int:
        free = max(0, self.concurrency - in_flight)
        return int(min(free, self.remaining(submitted)))

    def next_time_s(self, now_s: float, in_flight: int, submitted: int) -> float | None:
        return now_s if self.due(now_s, in_flight, submitted) > 0 else None

    def _take(self) -> int:
        k = self.due(0.0, self.in_flight, self.submitted)
        self.in_flight += k
        self.submitted += k
        return k

    def initial(self) -> int:
        """How many to submit at t=0."""
        if self.submitted:
            raise RuntimeError("initial() called twice")
        return self._take()

    def on_finish(self) -> int:
        """A request finished: how many to submit now (1, or 0 once num_requests were submitted)."""
        if self.in_flight <= 0:
            raise RuntimeError("on_finish() without a request in flight")
        self.in_flight -= 1
        return self._take()


class OpenLoopArrivals(ArrivalProcess):
    """Requests arrive at precomputed offsets (`arrival_offsets`), independent of completions."""

    def __init__(self, offsets: np.ndarray) -> None:
        self.offsets = np.asarray(offsets, dtype=np.float64)
        self.num_requests = len(self.offsets)

    def due(self, now_s: float, in_flight: int, submitted: int) -> int:
        arrived = int(np.searchsorted(self.offsets, now_s, side="right"))
        return max(0, arrived - submitted)

    def next_time_s(self, now_s: float, in_flight: int, submitted: int) -> float | None:
        if submitted >= self.num_requests:
            return None
        return max(now_s, float(self.offsets[submitted]))


class AllAtOnceArrivals(ArrivalProcess):
    """Every request due at t=0 (offline throughput)."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests

    def due(self, now_s: float, in_flight: int, submitted: int) -> int:
        return int(self.remaining(submitted))

    def next_time_s(self, now_s: float, in_flight: int, submitted: int) -> float | None:
        return now_s if self.remaining(submitted) > 0 else None


def make_arrival(
    arrival: ClosedLoop | OpenLoop | AllAtOnce, n: int | None, seed: int = 0, *, rescale: bool = True
) -> ArrivalProcess:
    """The process for a scenario's `arrival` config. `n` = requests to submit (None = unbounded, closed loop
    only; use `planned_requests` to get it). Same seed -> same open-loop offsets."""
    if isinstance(arrival, ClosedLoop):
        return ClosedLoopController(arrival.concurrency, n)
    if n is None:
        raise PerfkitError(f"arrival '{arrival.kind}' needs a request count (set num_requests)")
    if isinstance(arrival, OpenLoop):
        return OpenLoopArrivals(arrival_offsets(arrival.rate, arrival.burstiness, n, seed, rescale=rescale))
    if isinstance(arrival, AllAtOnce):
        return AllAtOnceArrivals(n)
    raise TypeError(f"unknown arrival config {type(arrival).__name__}")


# --------------------------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """A scenario's stop rules for submitting: at most `num_requests`, none after `duration_s` seconds.
    Requests already in flight when a limit is hit are the runner's to drain (or cancel)."""

    num_requests: int | None = None
    duration_s: float | None = None

    @classmethod
    def from_scenario(cls, scenario: ScenarioConfig) -> Limits:
        return cls(scenario.num_requests, scenario.duration_s)

    def may_submit(self, submitted: int, elapsed_s: float) -> bool:
        if self.num_requests is not None and submitted >= self.num_requests:
            return False
        return self.duration_s is None or elapsed_s < self.duration_s

    def clamp(self, k: int, submitted: int, elapsed_s: float) -> int:
        """`k` due requests cut to what the limits allow now."""
        if not self.may_submit(submitted, elapsed_s):
            return 0
        if self.num_requests is not None:
            k = min(k, self.num_requests - submitted)
        return max(0, k)


def planned_requests(scenario: ScenarioConfig) -> int | None:
    """How many requests to generate: num_requests when set; for an open loop limited only by duration, the
    arrivals that fit (ceil(rate * duration_s)); None (unbounded, stream them with `iter_requests`) for a closed
    loop limited only by duration. all_at_once without num_requests is an error."""
    if scenario.num_requests is not None:
        return scenario.num_requests
    arrival = scenario.arrival
    assert scenario.duration_s is not None
    if isinstance(arrival, OpenLoop):
        return max(1, math.ceil(arrival.rate * scenario.duration_s))
    if isinstance(arrival, AllAtOnce):
        raise PerfkitError(
            f"scenario {scenario.name}: arrival all_at_once needs num_requests (duration_s alone does not say how "
            "many requests to submit at t=0)"
        )
    return None
