"""The HF transformers peer: the same workloads through transformers' own Gemma4, measured beside perfkit's engine.

Random weights at the same shapes (built directly on the device in the target dtype by transformers' own init),
`generate` with greedy decoding and `min_new_tokens = max_new_tokens` for a fixed OSL. transformers has no
continuous batching, so the peer serves static batches: a closed loop at concurrency C runs the requests in
batches of C (a batch is submitted when the previous one finished), all-at-once runs them as one batch (split
by runtime.max_batch_size). Per-token host timestamps come from a streamer, which `generate` calls once per step
with the new tokens already copied to the host. Variable prompt lengths are left-padded with an attention mask.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from perfkit.capture.memory import MemoryTracker
from perfkit.capture.telemetry import TelemetrySampler
from perfkit.config import ClosedLoop, ModelConfig, RunConfig, ScenarioConfig, Toggles
from perfkit.errors import PerfkitError
from perfkit.results import ScenarioResult
from perfkit.runners.metrics import RequestRecord, compute_metrics
from perfkit.workloads.arrivals import planned_requests
from perfkit.workloads.requests import TokenSpace, generate_requests

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _StepClock:
    """A `generate` streamer that only timestamps: the first put is the prompt, every later one a new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.times_ns: list[int] = []

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times_ns.append(time.perf_counter_ns())

    def end(self) -> None:
        pass


def build_hf_model(model_cfg: Any, device: str, dtype: torch.dtype, seed: int) -> Any:
    """transformers' Gemma4ForCausalLM at the shapes of `model_cfg`, random weights initialised on `device`."""
    try:
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    except ImportError as err:
        raise PerfkitError(f"runner: hf needs transformers with Gemma4 (pip install -e .[test]): {err}") from None
    from perfkit.runtime.model_config import to_hf_config

    hf_cfg = Gemma4TextConfig(**to_hf_config(model_cfg))
    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma4ForCausalLM._from_config(hf_cfg, torch_dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


@dataclass
class HFPeerTarget:
    cfg: RunConfig
    model_cfg: ModelConfig
    device: str
    model: Any
    token_space: TokenSpace
    memory: MemoryTracker
    telemetry: TelemetrySampler
    build_s: float

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return f"  HF transformers peer: {n / 1e9:.2f} B params on {self.device}, built in {self.build_s:.1f} s"

    def recover(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.telemetry.stop()
        self.model = None
        self.recover()

    def run_scenario(
        self,
        scenario: ScenarioConfig,
        base: ScenarioResult,
        toggles: Toggles,
        on_progress: Callable[[int, float], None] | None = None,
    ) -> tuple[ScenarioResult, list[dict[str, Any]]]:
        n = planned_requests(scenario)
        if n is None:
            raise PerfkitError(f"scenario {scenario.name}: runner hf needs num_requests")
        batch = scenario.arrival.concurrency if isinstance(scenario.arrival, ClosedLoop) else n
        batch = min(batch, self.cfg.runtime.max_batch_size)
        requests = generate_requests(scenario.workload, n, self.token_space, scenario.workload.seed)
        if scenario.warmup_requests:
            warm = generate_requests(scenario.workload, min(batch, scenario.warmup_requests), self.token_space,
                                     scenario.workload.seed + 1_000_003)
            self._generate(warm)
        mark = self.telemetry.mark()
        records: list[RequestRecord] = []
        t0 = time.perf_counter_ns()
        with self.memory.phase(f"scenario:{scenario.name}"):
            for start in range(0, n, batch):
                records += self._generate(requests[start : start + batch])
                if on_progress is not None:
                    done_s = (time.perf_counter_ns() - t0) / 1e9
                    on_progress(len(records), sum(r.output_tokens for r in records) / max(done_s, 1e-9))
        sm = compute_metrics(records, scenario.slo, scenario.warmup_requests)
        result = base.model_copy(
            update={
                "runtime": {"runner": "hf", "batch_size": batch, "transformers": _version(), "build_s": self.build_s},
                "arm": {"runner": "hf"},
                "counts": sm.counts,
                "metrics": sm.metrics,
                "throughput": sm.throughput,
                "memory": self.memory.section(),
                "telemetry": self.telemetry.section(mark),
            }
        )
        ctx = {"scenario": base.name, "arm": base.arm_name, "repeat": base.repeat}
        return result, [r.to_json(**ctx) for r in records]

    @torch.no_grad()
    def _generate(self, reqs: list) -> list[RequestRecord]:
        """One static batch: left-padded prompts, fixed output length (the batch's longest OSL)."""
        pad = self.model.config.pad_token_id or 0
        width = max(r.input_len for r in reqs)
        ids = torch.full((len(reqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - r.input_len :] = torch.from_numpy(r.prompt_token_ids.astype("int64"))
            mask[i, width - r.input_len :] = 1
        osl = max(r.output_len for r in reqs)
        clock = _StepClock()
        ids, mask = ids.to(self.device), mask.to(self.device)
        submit_ns = time.perf_counter_ns()
        self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=osl, min_new_tokens=osl, do_sample=False,
            streamer=clock, pad_token_id=pad,
        )  # fmt: skip
        return [
            RequestRecord(
                request_id=r.request_id,
                input_text_tokens=r.num_text_tokens,
                input_vision_tokens=r.num_vision_tokens,
                submit_ns=submit_ns,
                scheduled_ns=submit_ns,
                token_ns=clock.times_ns[: r.output_len],
            )
            for r in reqs
        ]


def _version() -> str | None:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return None


def load_hf_target(cfg: RunConfig, mcfg: ModelConfig, device: str, model_cfg: Any) -> HFPeerTarget:
    if mcfg.weights != "random":
        raise PerfkitError("runner: hf builds random weights at the preset's shapes; use model.weights: random")
    memory = MemoryTracker(enabled=cfg.capture.memory)
    telemetry = TelemetrySampler(interval_ms=cfg.capture.telemetry_interval_ms,
                                 enabled=cfg.capture.telemetry and device == "cuda")
    t0 = time.perf_counter()
    with memory.phase("weights_load"):
        model = build_hf_model(model_cfg, device, _DTYPES[mcfg.dtype], mcfg.seed)
    build_s = round(time.perf_counter() - t0, 3)
    telemetry.start()
    return HFPeerTarget(cfg, mcfg, device, model, TokenSpace.from_model_config(model_cfg), memory, telemetry, build_s)
