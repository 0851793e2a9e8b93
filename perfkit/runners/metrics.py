"""Serving metrics from per-request host timestamps (DESIGN.md's metric table, trtllm-bench conventions).

| name | definition |
| ttft_ms | first output token available on the host - request submitted to the engine |
| tpot_ms | per request: (last token - first token) / (n_out - 1) |
| itl_ms | every gap between consecutive tokens of a request, pooled over requests |
| e2el_ms | last token - submitted |
| queue_ms | scheduled for the first time - submitted |
| output_tok_s | sum n_out / (last finish - first submit); total_tok_s adds input tokens; request_s |
| per_user_tok_s | 1000 / tpot_ms, per request |

All timestamps are `time.perf_counter_ns()` taken in-process. Input token counts come from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfkit.config import SLO
from perfkit.results import Counts, Stats, Throughput
from perfkit.stats import summarize

METRIC_NAMES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms", "per_user_tok_s")


@dataclass
class RequestRecord:
    """One measured request: what the engine counted and when each token reached the host."""

    request_id: int
    input_text_tokens: int
    input_vision_tokens: int
    submit_ns: int
    scheduled_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)  # one host timestamp per output token

    @property
    def output_tokens(self) -> int:
        return len(self.token_ns)

    def ttft_ms(self) -> float | None:
        return (self.token_ns[0] - self.submit_ns) / 1e6 if self.token_ns else None

    def tpot_ms(self) -> float | None:
        n = len(self.token_ns)
        return (self.token_ns[-1] - self.token_ns[0]) / 1e6 / (n - 1) if n > 1 else None

    def e2el_ms(self) -> float | None:
        return (self.token_ns[-1] - self.submit_ns) / 1e6 if self.token_ns else None

    def queue_ms(self) -> float | None:
        return (self.scheduled_ns - self.submit_ns) / 1e6 if self.scheduled_ns is not None else None

    def itl_ms(self) -> list[float]:
        return (np.diff(np.asarray(self.token_ns, dtype=np.int64)) / 1e6).tolist()

    def meets(self, slo: SLO | None) -> bool:
        if slo is None:
            return True
        checks = [(slo.ttft_ms, self.ttft_ms()), (slo.tpot_ms, self.tpot_ms()), (slo.e2el_ms, self.e2el_ms())]
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)

    def to_json(self, **context: Any) -> dict[str, Any]:
        """The requests.jsonl line: context (scenario, arm, repeat), counts, raw timestamps, derived metrics."""
        tpot = self.tpot_ms()
        return {
            **context,
            "request_id": self.request_id,
            "input_text_tokens": self.input_text_tokens,
            "input_vision_tokens": self.input_vision_tokens,
            "output_tokens": self.output_tokens,
            "submit_ns": self.submit_ns,
            "scheduled_ns": self.scheduled_ns,
            "first_token_ns": self.token_ns[0] if self.token_ns else None,
            "last_token_ns": self.token_ns[-1] if self.token_ns else None,
            "token_ns": self.token_ns,
            "ttft_ms": self.ttft_ms(),
            "tpot_ms": tpot,
            "e2el_ms": self.e2el_ms(),
            "queue_ms": self.queue_ms(),
            "per_user_tok_s": 1000.0 / tpot if tpot else None,
        }


@dataclass
class ScenarioMetrics:
    metrics: dict[str, Stats]
    throughput: Throughput
    counts: Counts


def _present(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def compute_metrics(
    records: list[RequestRecord], slo: SLO | None = None, warmup_requests: int = 0, preemptions: int = 0
) -> ScenarioMetrics:
    """Distributions, throughput and goodput of the measured (non-warmup) requests of one scenario."""
    done = [r for r in records if r.token_ns]
    metrics = {
        "ttft_ms": summarize(_present([r.ttft_ms() for r in done])),
        "tpot_ms": summarize(_present([r.tpot_ms() for r in done])),
        "itl_ms": summarize([g for r in done for g in r.itl_ms()]),
        "e2el_ms": summarize(_present([r.e2el_ms() for r in done])),
        "queue_ms": summarize(_present([r.queue_ms() for r in done])),
        "per_user_tok_s": summarize([1000.0 / t for t in _present([r.tpot_ms() for r in done]) if t > 0]),
    }
    n_out = sum(r.output_tokens for r in done)
    n_in = sum(r.input_text_tokens + r.input_vision_tokens for r in done)
    if done:
        span_s = (max(r.token_ns[-1] for r in done) - min(r.submit_ns for r in done)) / 1e9
    else:
        span_s = 0.0
    rate = (lambda x: x / span_s) if span_s > 0 else (lambda x: 0.0)
    good = sum(r.meets(slo) for r in done)
    throughput = Throughput(
        output_tok_s=rate(n_out),
        total_tok_s=rate(n_out + n_in),
        request_s=rate(len(done)),
        goodput_request_s=rate(good) if slo is not None else None,
        goodput_fraction=(good / len(done) if done else 0.0) if slo is not None else None,
    )
    counts = Counts(
        requests=len(done),
        warmup_requests=warmup_requests,
        input_text_tokens=sum(r.input_text_tokens for r in done),
        input_vision_tokens=sum(r.input_vision_tokens for r in done),
        output_tokens=n_out,
        duration_s=span_s,
        preemptions=preemptions,
    )
    return ScenarioMetrics(metrics=metrics, throughput=throughput, counts=counts)
