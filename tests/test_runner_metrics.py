"""Serving metrics on hand-built timelines, and the in-process drive loop against a fake engine."""

from dataclasses import dataclass

import pytest

from perfkit.config import SLO, AllAtOnce, ClosedLoop, OpenLoop, WorkloadConfig
from perfkit.runners.inprocess import drive
from perfkit.runners.metrics import RequestRecord, compute_metrics
from perfkit.workloads.arrivals import Limits, make_arrival
from perfkit.workloads.requests import TokenSpace, iter_requests

MS = 1_000_000


def test_metrics_on_a_hand_built_timeline():
    # request 0: submitted 0, scheduled 1 ms, tokens at 10, 12, 16 ms  -> TTFT 10, TPOT 3, ITL [2, 4], E2EL 16
    # request 1: submitted 5 ms, scheduled 6 ms, tokens at 20, 21 ms   -> TTFT 15, TPOT 1, ITL [1], E2EL 16
    recs = [
        RequestRecord(0, 100, 0, 0, 1 * MS, [10 * MS, 12 * MS, 16 * MS]),
        RequestRecord(1, 50, 280, 5 * MS, 6 * MS, [20 * MS, 21 * MS]),
    ]
    m = compute_metrics(recs, SLO(ttft_ms=12))
    assert m.metrics["ttft_ms"].mean == pytest.approx(12.5) and m.metrics["ttft_ms"].p50 == pytest.approx(12.5)
    assert m.metrics["tpot_ms"].min == pytest.approx(1) and m.metrics["tpot_ms"].max == pytest.approx(3)
    assert m.metrics["itl_ms"].n == 3 and m.metrics["itl_ms"].mean == pytest.approx(7 / 3)
    assert m.metrics["e2el_ms"].mean == pytest.approx(16)
    assert m.metrics["queue_ms"].mean == pytest.approx(1)
    assert m.metrics["per_user_tok_s"].max == pytest.approx(1000)
    # span = last token 21 ms - first submit 0 -> 5 output tokens / 0.021 s
    assert m.throughput.output_tok_s == pytest.approx(5 / 0.021)
    assert m.throughput.total_tok_s == pytest.approx((5 + 430) / 0.021)
    assert m.throughput.request_s == pytest.approx(2 / 0.021)
    assert m.throughput.goodput_fraction == pytest.approx(0.5)  # only request 0 meets TTFT <= 12 ms
    assert (m.counts.input_text_tokens, m.counts.input_vision_tokens, m.counts.output_tokens) == (150, 280, 5)
    line = recs[0].to_json(scenario="s", arm="a", repeat=0)
    assert line["ttft_ms"] == pytest.approx(10) and line["token_ns"] == [10 * MS, 12 * MS, 16 * MS]


def test_single_token_requests_have_no_tpot():
    m = compute_metrics([RequestRecord(0, 10, 0, 0, 0, [3 * MS])])
    assert m.metrics["tpot_ms"].n == 0 and m.metrics["ttft_ms"].p99 == pytest.approx(3)
    assert m.throughput.goodput_fraction is None


@dataclass
class _Out:
    request_id: int
    new_token_ids: list
    t_host_ns: int
    finished: bool
    first_scheduled_ns: int | None = None


class _Req:
    def __init__(self, n):
        self.left, self.first_scheduled_ns = n, None


class FakeEngine:
    """Each step emits one token for every running request; records the max concurrency it ever saw."""

    def __init__(self, clock):
        self.clock, self.reqs, self.max_running, self.next = clock, {}, 0, 0

    def add_request(self, ids, mm_items=None, max_new_tokens=1, ignore_eos=True, token_type_ids=None):
        rid = self.next
        self.next += 1
        self.reqs[rid] = _Req(max_new_tokens)
        return rid

    def request(self, rid):
        return self.reqs[rid]

    def step(self):
        self.clock.t += 2 * MS
        live = [r for r, q in self.reqs.items() if q.left > 0]
        self.max_running = max(self.max_running, len(live))
        outs = []
        for rid in live:
            q = self.reqs[rid]
            q.first_scheduled_ns = q.first_scheduled_ns or self.clock.t
            q.left -= 1
            outs.append(_Out(rid, [7], self.clock.t, q.left == 0, q.first_scheduled_ns))
        return outs


class Clock:
    def __init__(self):
        self.t = 0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += int(s * 1e9) + 1


def _requests(n_osl=4):
    wl = WorkloadConfig(isl={"mean": 8}, osl={"mean": n_osl})
    return iter_requests(wl, TokenSpace(vocab_size=64, image_token_id=60, video_token_id=61, boi_token_id=62,
                                        eoi_token_id=63))


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_closed_loop_never_exceeds_concurrency(concurrency):
    clock = Clock()
    eng = FakeEngine(clock)
    out = drive(eng, _requests(), make_arrival(ClosedLoop(concurrency=concurrency), 20), Limits(20, None),
                clock=clock, sleep=clock.sleep)
    assert len(out.records) == 20 and eng.max_running == concurrency
    assert all(r.output_tokens == 4 and r.scheduled_ns is not None for r in out.records)


def test_open_loop_waits_for_arrivals_and_all_at_once_submits_everything():
    clock = Clock()
    eng = FakeEngine(clock)
    out = drive(eng, _requests(), make_arrival(OpenLoop(rate=10.0), 5), Limits(5, None), clock=clock,
                sleep=clock.sleep)
    submits = [r.submit_ns / 1e9 for r in out.records]
    assert len(submits) == 5 and submits[-1] >= 0.39  # 5 arrivals at 10/s span 0.4 s
    clock = Clock()
    eng = FakeEngine(clock)
    out = drive(eng, _requests(), make_arrival(AllAtOnce(), 6), Limits(6, None), clock=clock, sleep=clock.sleep)
    assert eng.max_running == 6 and {r.submit_ns for r in out.records} == {0}


def test_duration_limit_stops_submitting_but_finishes_in_flight():
    clock = Clock()
    eng = FakeEngine(clock)
    out = drive(eng, _requests(n_osl=10), make_arrival(ClosedLoop(concurrency=2), None), Limits(None, 0.05),
                clock=clock, sleep=clock.sleep)
    assert out.stopped_by_duration
    assert all(r.output_tokens == 10 for r in out.records)  # nothing cut off mid-request
    assert max(r.submit_ns for r in out.records) < 0.05e9
