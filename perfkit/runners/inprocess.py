"""Drive the bundled engine in-process under one scenario's arrival process and record per-token host times.

No HTTP, no streaming chunking: a token's timestamp is taken by the engine right after the sampled ids reach the
host (`StepOutput.t_host_ns`), and a request's submit time right before `engine.add_request`. The loop:

    while requests remain or are in flight:
        submit what the arrival process allows now (never more than C in flight for a closed loop)
        if anything is in flight: engine.step() and record its tokens
        else: sleep until the next arrival
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from perfkit.runners.metrics import RequestRecord
from perfkit.workloads.arrivals import ArrivalProcess, Limits
from perfkit.workloads.requests import Request

MMMaterializer = Callable[[Request], list[dict[str, Any]] | None]


@dataclass
class DriveOutcome:
    records: list[RequestRecord]
    steps: int
    stopped_by_duration: bool


_STEP, _WAIT, _STOP = "step", "wait", "stop"


def drive(
    engine: Any,
    requests: Iterator[Request],
    arrival: ArrivalProcess,
    limits: Limits,
    materialize_mm: MMMaterializer | None = None,
    on_step: Callable[[int, int, list[RequestRecord]], None] | None = None,
    clock: Callable[[], int] = time.perf_counter_ns,
    sleep: Callable[[float], None] = time.sleep,
    control: Callable[[Any], Any] | None = None,
    leader: bool = True,
) -> DriveOutcome:
    """Submit `requests` as `arrival` allows within `limits`, step the engine until all submitted finish.

    `materialize_mm` turns a request's multimodal items into the engine's pixel inputs; it runs before the
    submit timestamp is taken, so image synthesis is not charged to TTFT. `on_step(step_idx, records)` is the
    hook for progress displays and profiler windows: `on_step(steps, finished, records)`.

    Tensor parallelism: `control` is a broadcast from the leader (rank 0: `TPContext.broadcast_object`). Every
    iteration the leader decides from its clock what to do (how many requests it submitted, then step / wait /
    stop) and sends it; the other ranks (`leader=False`) submit as many requests from their own, identically
    seeded iterators and do the same, so every rank calls `engine.step()` the same number of times with the
    same batches. Followers never read the clock for a decision and never sleep (they wait in the broadcast).
    """
    t0 = clock()
    records: dict[int, RequestRecord] = {}  # engine request id -> record
    order: list[RequestRecord] = []
    submitted = 0
    steps = 0
    in_flight = 0
    finished = 0
    stopped_by_duration = False
    exhausted = False

    def submit(req: Request) -> None:
        nonlocal submitted, in_flight
        mm = materialize_mm(req) if (materialize_mm is not None and req.mm_items) else None
        submit_ns = clock()
        rid = engine.add_request(
            req.prompt_token_ids.tolist(),
            mm_items=mm,
            max_new_tokens=req.output_len,
            ignore_eos=True,
            token_type_ids=req.token_type_ids.tolist(),
        )
        rec = RequestRecord(
            request_id=req.request_id,
            input_text_tokens=req.num_text_tokens,
            input_vision_tokens=req.num_vision_tokens,
            submit_ns=submit_ns,
        )
        records[rid] = rec
        order.append(rec)
        submitted += 1
        in_flight += 1

    while True:
        if leader:
            now_s = (clock() - t0) / 1e9
            k_done = 0
            if not exhausted:
                k = limits.clamp(arrival.due(now_s, in_flight, submitted), submitted, now_s)
                for _ in range(k):
                    req = next(requests, None)
                    if req is None:
                        exhausted = True
                        break
                    submit(req)
                    k_done += 1
                if not limits.may_submit(submitted, now_s):
                    stopped_by_duration = limits.duration_s is not None and now_s >= limits.duration_s
                    exhausted = True
            action, wake = _STEP, None
            if in_flight == 0:
                wake = None if exhausted else arrival.next_time_s(now_s, in_flight, submitted)
                action = _STOP if wake is None else _WAIT
            if control is not None:
                control((k_done, action, stopped_by_duration))
            if action == _WAIT:
                sleep(max(0.0, min(wake - now_s, 0.05)))
                continue
        else:
            k_done, action, stopped_by_duration = control(None)  # type: ignore[misc]
            for _ in range(k_done):
                req = next(requests, None)
                if req is None:
                    raise RuntimeError("tensor parallel ranks diverged: this rank ran out of requests first")
                submit(req)
        if action == _STOP:
            break
        if action == _WAIT:
            continue
        for out in engine.step():
            rec = records[out.request_id]
            if rec.scheduled_ns is None:
                rec.scheduled_ns = out.first_scheduled_ns
            rec.token_ns.extend([out.t_host_ns] * len(out.new_token_ids))
            if out.finished:
                in_flight -= 1
                finished += 1
        steps += 1
        if on_step is not None:
            on_step(steps, finished, order)
    return DriveOutcome(records=order, steps=steps, stopped_by_duration=stopped_by_duration)
