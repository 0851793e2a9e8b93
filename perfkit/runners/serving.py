"""One loaded model served by the bundled engine, with its capture instruments, for the scenarios of a suite.

`load_target` builds the model once (weights, vision tower when a scenario has images) and the engine (KV pool
sized from measured free memory), under memory phases `weights_load` and `kv_pool`. `run_scenario` sets the
arm's toggles on the live engine, on a GPU runs the engine's warmup prefills when this toggle state has not run
them (`Engine.warm_up`), runs the warmup requests (both excluded), then the measured ones under the scenario's
arrival process, and assembles the ScenarioResult: metrics, throughput, counts, memory, NVTX ranges,
telemetry and roofline.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perfkit.capture.jit import JitCompileLog
from perfkit.capture.memory import MemoryTracker
from perfkit.capture.profiler import ProfileWindow
from perfkit.capture.ranges import DEVICE_RANGES, RangeRecorder
from perfkit.capture.syncs import SyncCounter
from perfkit.capture.telemetry import TelemetrySampler
from perfkit.config import ModelConfig, RunConfig, ScenarioConfig, Toggles
from perfkit.kernels.fp8_gemv import gemv_max_m as fp8_gemv_max_m
from perfkit.results import RooflineSection, ScenarioResult
from perfkit.roofline import MEASURED_H200, get_gpu_peak, match_gpu, roofline_section
from perfkit.runners.inprocess import drive
from perfkit.runners.metrics import compute_metrics
from perfkit.workloads.arrivals import Limits, make_arrival, planned_requests
from perfkit.workloads.requests import Request, TokenSpace, iter_requests

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_WARMUP_SEED_OFFSET = 1_000_003  # warmup requests: same mix, other content


@dataclass
class ServingTarget:
    cfg: RunConfig
    model_cfg: ModelConfig
    device: str
    run_dir: Path
    model: Any
    engine: Any
    vision_tower: Any
    memory: MemoryTracker
    ranges: RangeRecorder
    telemetry: TelemetrySampler
    token_space: TokenSpace
    setup_s: dict[str, float] = field(default_factory=dict)
    quant: dict[str, Any] = field(default_factory=dict)
    tp: Any = None  # tp_launch.TPContext under tensor parallelism (world_size > 1), else None
    tp_summary: dict[str, Any] = field(default_factory=dict)  # runtime["tp"]: what this rank holds

    @property
    def world_size(self) -> int:
        return 1 if self.tp is None else self.tp.world_size

    @property
    def leader(self) -> bool:
        """The rank that decides when to submit and records (always True without tensor parallelism)."""
        return self.tp is None or self.tp.is_rank0

    def _drive_control(self) -> dict[str, Any]:
        return {} if self.tp is None else {"control": self.tp.broadcast_object, "leader": self.tp.is_rank0}

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def describe(self) -> str:
        from perfkit.runtime.model_config import param_count

        full = getattr(self.model.cfg, "full_config", None)  # tensor parallel: count the whole model
        pc = param_count(full() if full is not None else self.model.cfg)
        st = self.engine.stats
        pages = ", ".join(f"{k} {v}" for k, v in st.kv_pages.items())
        q = self.quant
        quant_line = ""
        if q.get("scheme", "bf16") != "bf16":
            why = {
                "w4a16-triton": "NVFP4 weights through the W4A16 Triton GEMM (no FP4 tensor cores on this GPU)",
                "fp4-native": "NVFP4 weights on FP4 tensor cores (FlashInfer)",
                "fp8-scaled-mm": f"FP8 weights: rows of M <= {q.get('fp8_gemv_max_m', 1)} through the weight-only "
                "Triton GEMV, larger M W8A8 through torch._scaled_mm",
            }.get(q["quant_backend"], f"{q['scheme']} weights via {q['quant_backend']}")
            quant_line = f"\n  quant: {why} (quant_backend {q['quant_backend']})"
        return (
            f"  {self.model.cfg.name}: {pc.total / 1e9:.2f} B params on {self.device}"
            f"{'' if self.tp is None else f' x {self.world_size} (tensor parallel)'} ({self.model_cfg.dtype}); "
            f"weights {self.setup_s.get('weights_s', 0):.1f} s, engine {self.setup_s.get('engine_s', 0):.1f} s; "
            f"KV pages: {pages}{quant_line}"
        )

    def recover(self) -> None:
        """After a failed scenario: drop every request and free cached memory so the next scenario starts clean."""
        self.engine.abort_all()
        self.ranges.reset()
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _warm_up_engine(self) -> list[int] | str:
        """``Engine.warm_up``, best effort: a max_num_tokens prefill that does not fit beside the KV pool under this
        arm's toggles (the torch attention backend's scores, say; the pool was sized after the first arm's warmup)
        must not fail an arm whose scenario never prefills that much. Its compiles then fall in the measured window,
        where ``runtime.jit_compiles`` reports them."""
        try:
            return self.engine.warm_up()
        except torch.cuda.OutOfMemoryError:
            self.recover()
            return "out of memory"

    def close(self) -> None:
        self.telemetry.stop()
        self.engine = self.model = self.vision_tower = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ---- one scenario ----------------------------------------------------------------------------------------
    def run_scenario(
        self,
        scenario: ScenarioConfig,
        base: ScenarioResult,
        toggles: Toggles,
        on_progress: Callable[[int, float], None] | None = None,
    ) -> tuple[ScenarioResult, list[dict[str, Any]]]:
        engine = self.engine
        for name, value in toggles.model_dump().items():
            engine.set_toggle(name, value)
        needs_vision = scenario.workload.images is not None or scenario.workload.video is not None
        materialize = self._materializer() if needs_vision else None
        n = planned_requests(scenario)
        wl_seed = scenario.workload.seed

        # warmup, excluded from everything measured: the engine's prefill sizes once per toggle state (an arm's
        # toggles launch kernel forms not compiled yet), then requests of the same mix with other content
        warm_jit = JitCompileLog(self.ranges)
        warm_prefills: list[int] | str = []
        with warm_jit:
            if self.device == "cuda":
                warm_prefills = self._warm_up_engine()
            if scenario.warmup_requests:
                warm = iter_requests(scenario.workload, self.token_space, wl_seed + _WARMUP_SEED_OFFSET)
                drive(engine, warm, make_arrival(scenario.arrival, scenario.warmup_requests, wl_seed),
                      Limits(scenario.warmup_requests, None), materialize, **self._drive_control())
        self.ranges.reset()
        preempt0 = engine.stats.preemptions
        mark = self.telemetry.mark()
        profile = self._profile_window(scenario, base)

        def on_step(step: int, finished: int, records: list) -> None:
            profile.on_step(step)
            if on_progress is not None and (step & 15) == 0 and records:
                elapsed_s = max(1e-9, (time.perf_counter_ns() - records[0].submit_ns) / 1e9)
                on_progress(finished, sum(r.output_tokens for r in records) / elapsed_s)

        requests = iter_requests(scenario.workload, self.token_space, wl_seed)
        syncs = SyncCounter(self.ranges) if self.cfg.capture.sync_counts and self.device == "cuda" else None
        jit = JitCompileLog(self.ranges)
        with self.memory.phase(f"scenario:{scenario.name}"), profile, syncs or contextlib.nullcontext(), jit:
            outcome = drive(engine, requests, make_arrival(scenario.arrival, n, wl_seed), Limits.from_scenario(scenario),
                            materialize, on_step, **self._drive_control())
        if self.device == "cuda":
            torch.cuda.synchronize()
        sm = compute_metrics(outcome.records, scenario.slo, scenario.warmup_requests,
                             engine.stats.preemptions - preempt0)
        st = engine.stats
        runtime = {
            "attention": toggles.attention,
            "steps": outcome.steps,
            "stopped_by_duration": outcome.stopped_by_duration,
            "kv_pages": st.kv_pages,
            "kv_pool_bytes": st.kv_pool_bytes,
            "graph_batch_sizes": st.graph_batch_sizes,
            "graph_capture_s": round(st.graph_capture_s, 3),
            "encoder_calls": st.encoder_calls,
            "kv_dtype": st.kv_dtype,
            "kv_scales": st.kv_scales,
            "decode_gemv": st.decode_gemv,
            "w4a16_words": st.w4a16_words,
            "setup_s": self.setup_s,
            "quant": self.quant,
            "tp": self.tp_summary,
            "jit_compiles": jit.summary(),  # inside the measured window: should be none
            "warmup_jit_compiles": {"compiles": warm_jit.compiles, "seconds": warm_jit.summary()["seconds"]},
            "warmup_prefill_tokens": warm_prefills,  # Engine.warm_up's sizes: none when this toggle state was warm
        }
        throughput = sm.throughput
        if throughput is not None:  # output_tok_s stays the whole system's; per GPU = / world size
            w = self.world_size
            throughput = throughput.model_copy(update={"output_tok_s_per_gpu": throughput.output_tok_s / w,
                                                       "total_tok_s_per_gpu": throughput.total_tok_s / w})
        if profile.trace_path is not None:
            runtime["profile_trace"] = str(profile.trace_path)
        if profile.summary is not None:
            runtime["profile"] = profile.summary
        if syncs is not None:
            runtime["syncs"] = syncs.summary(self.ranges.counts())
        nvtx = self.ranges.summary()
        result = base.model_copy(
            update={
                "message": jit.message(),
                "runtime": runtime,
                "counts": sm.counts,
                "metrics": sm.metrics,
                "throughput": throughput,
                "memory": self.memory.section(),
                "nvtx": nvtx,
                "telemetry": self.telemetry.section(
                    mark, self.run_dir, stem=f"{base.name.replace('/', '_')}-{base.arm_name}-{base.repeat}"
                ),
                "roofline": self._roofline(scenario, sm),
            }
        )
        ctx = {"scenario": base.name, "arm": base.arm_name, "repeat": base.repeat}
        return result, [r.to_json(**ctx) for r in outcome.records]

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _materializer(self) -> Callable[[Request], list[dict[str, Any]]]:
        from perfkit.runtime.vision import synthetic_images

        if self.vision_tower is None:
            self.vision_tower = _build_vision(self.model_cfg, self.model, self.device)
            self.engine.set_vision_tower(self.vision_tower)
        dtype = _DTYPES[self.model_cfg.dtype]

        def materialize(req: Request) -> list[dict[str, Any]]:
            items = []
            for item in req.mm_items:
                # frames of one item draw seeds item.seed*4096 + f: distinct from every other item's
                seed = (item.seed % (1 << 40)) * 4096
                pv, pp = synthetic_images(item.num_frames, item.num_soft_tokens, seed, self.device, dtype)
                for f in range(item.num_frames):  # one vision run per image / per video frame
                    items.append({"pixel_values": pv[f : f + 1], "pixel_position_ids": pp[f : f + 1]})
            return items

        return materialize

    def _profile_window(self, scenario: ScenarioConfig, base: ScenarioResult) -> ProfileWindow:
        """The scenario's profiler window. Its files are named by scenario, arm and repeat
        (``<scenario>.<arm>.r<repeat>``): every run of an A/B keeps its own trace."""
        cap = self.cfg.capture
        wanted = cap.profile != "none" and (cap.profile_scenario in (None, scenario.name)) and self.leader
        if not wanted:
            return ProfileWindow("none")
        start, stop = cap.profile_steps
        name = f"{scenario.name}.{base.arm_name}.r{base.repeat}"
        return ProfileWindow(cap.profile, start, stop, self.run_dir / "profiles", name=name)

    def _roofline(self, scenario: ScenarioConfig, sm: Any) -> RooflineSection:
        if self.device != "cuda":
            return RooflineSection(notes="no GPU: roofline not computed")
        if self.world_size > 1:
            return RooflineSection(notes=f"tensor parallel (TP={self.world_size}): per-GPU roofline not computed yet")
        key = match_gpu(torch.cuda.get_device_name(0))
        if key is None:
            return RooflineSection(notes=f"no peak table entry for {torch.cuda.get_device_name(0)}")
        # this workplace measured the H200's copy bandwidth and bf16 matmul rate: the honest ceilings there
        peak = get_gpu_peak(key, MEASURED_H200 if key == "h200" else None)
        w = scenario.workload
        isl = (w.isl.mean if w.isl is not None else 0) + w.shared_prefix_len
        if w.images is not None:
            isl += w.images.count * (w.images.tokens_per_image + 2)
        osl = w.osl.mean
        batch = getattr(scenario.arrival, "concurrency", None) or scenario.num_requests or 1
        batch = min(batch, self.cfg.runtime.max_batch_size)
        tpot = sm.metrics["tpot_ms"].p50
        ttft = sm.metrics["ttft_ms"].p50 if batch == 1 else None
        model_bytes = float(self.model.dtype.itemsize)
        q = self.quant
        # quantised decoder weights: their bytes per parameter as loaded (values + scales); the LM head stays
        weight_bytes = model_bytes * q["quantized_bytes_after"] / q["quantized_bytes_before"] if "quant_backend" in q \
            else model_bytes  # fmt: skip
        closed = scenario.arrival.kind in ("closed", "all_at_once")
        out_tok_s = sm.throughput.output_tok_s if sm.throughput is not None else None
        return roofline_section(
            self.model.cfg,
            peak,
            decode_ctx_lens=[isl + osl // 2] * batch if osl > 1 else None,
            decode_step_ms=tpot,
            prefill_seq_lens=[isl] if batch == 1 else None,
            prefill_ms=ttft,
            weight_dtype_bytes=weight_bytes,
            lm_head_dtype_bytes=model_bytes,
            kv_dtype_bytes=float(self.engine.kv.dtype.itemsize),
            serving=(int(isl), int(osl), int(batch)) if closed else None,
            output_tok_s=out_tok_s,
        )


def model_config_for(mcfg: ModelConfig):
    from perfkit.runtime.model_config import from_hf_config, get_preset

    if mcfg.path is not None:
        import json

        cfg = from_hf_config(json.loads((Path(mcfg.path) / "config.json").read_text()), name=Path(mcfg.path).name)
    else:
        cfg = get_preset(mcfg.preset, num_layers=mcfg.num_layers)
    if mcfg.sliding_window is not None:
        from dataclasses import replace

        cfg = replace(cfg, sliding_window=mcfg.sliding_window)
    return cfg


def _build_vision(mcfg: ModelConfig, model: Any, device: str) -> Any:
    from perfkit.runtime.vision import build_vision_tower, load_vision_weights, vision_config_for
    from perfkit.runtime.weights import load_hf_state

    cfg = model.cfg
    vcfg = cfg.vision if getattr(cfg, "vision", None) is not None else vision_config_for(mcfg.preset or "31b")
    dtype = _DTYPES[mcfg.dtype]
    if mcfg.weights == "hf":
        tower = build_vision_tower(vcfg, cfg.hidden_size, device, dtype, init=False)
        load_vision_weights(tower, load_hf_state(mcfg.path))
        return tower
    return build_vision_tower(vcfg, cfg.hidden_size, device, dtype, seed=mcfg.seed + 1)


def load_target(
    cfg: RunConfig, mcfg: ModelConfig, device: str, run_dir: Path, toggles: Toggles, tp: Any = None
) -> ServingTarget:
    """Build model + engine once for a suite's scenarios, under memory phases.

    `tp` (a tp_launch.TPContext; used when its world_size > 1): build only this rank's shard (quantised shards
    get their all-reduce wrappers back; the vision tower is replicated), size the KV pools per rank from the
    sharded config with one page count on every rank (the minimum), NVML telemetry on rank 0 only."""
    from perfkit.runtime.engine import Engine, EngineConfig
    from perfkit.runtime.quant import apply_quant
    from perfkit.runtime.tp import build_sharded_model, reattach_tp_, tp_summary
    from perfkit.runtime.weights import build_model

    if tp is not None and tp.world_size == 1:
        tp = None
    cap = cfg.capture
    memory = MemoryTracker(enabled=cap.memory)
    ranges = RangeRecorder(
        enabled=cap.nvtx, device_timing=cap.device_timing and device == "cuda", device_ranges=DEVICE_RANGES
    )
    telemetry = TelemetrySampler(interval_ms=cap.telemetry_interval_ms,
                                 enabled=cap.telemetry and device == "cuda" and (tp is None or tp.is_rank0))
    if device != "cuda" and cap.telemetry:
        telemetry.reason = "no CUDA device"
    model_cfg = model_config_for(mcfg)
    setup: dict[str, float] = {}
    t0 = time.perf_counter()
    with memory.phase("weights_load"):
        if tp is None:
            model = build_model(model_cfg, device, _DTYPES[mcfg.dtype], mcfg.weights, mcfg.path, mcfg.seed)
        else:
            model = build_sharded_model(model_cfg, tp.rank, tp.world_size, device, _DTYPES[mcfg.dtype], mcfg.seed,
                                        mcfg.weights, mcfg.path, group=tp.group)
        quant = apply_quant(model, mcfg.quant)  # None for bf16
        if tp is not None and quant is not None:
            reattach_tp_(model)  # quantisation swapped o_proj / down_proj / experts: restore their all-reduce
        if device == "cuda":
            torch.cuda.synchronize()
    setup["weights_s"] = round(time.perf_counter() - t0, 3)
    tensors = list(model.parameters()) + list(model.buffers())
    memory.set_weights_bytes(sum(t.numel() * t.element_size() for t in tensors))
    needs_vision = any(s.workload.images is not None or s.workload.video is not None for s in cfg.scenarios)
    vision = _build_vision(mcfg, model, device) if needs_vision else None
    rt = cfg.runtime
    ec = EngineConfig(
        attention=toggles.attention,
        page_size=rt.page_size,
        kv_cache_fraction=rt.kv_cache_fraction,
        max_batch_size=rt.max_batch_size,
        max_num_tokens=rt.max_num_tokens,
        max_model_len=rt.max_model_len,
        kv_dtype="fp8" if rt.kv_dtype == "fp8" else "auto",  # bf16 means the model dtype (float32 on CPU tests)
        cuda_graphs=toggles.cuda_graphs == "on",
        page_table=toggles.page_table,
        mask=toggles.mask,
        mm_embed_cache=toggles.mm_embed_cache == "on",
        fused_kernels=toggles.fused_kernels == "on",
        overlap=toggles.overlap == "on",
        moe_gather=toggles.moe_gather,
        moe_prefill=toggles.moe_prefill,
        decode_attention=toggles.decode_attention,
        decode_gemv=toggles.decode_gemv,
        pdl=toggles.pdl == "on",
        decode_fusion=toggles.decode_fusion == "on",
        decode_routing=toggles.decode_routing == "fused",
        decode_moe_ffn=toggles.decode_moe_ffn,
        decode_prologue=toggles.decode_prologue == "fused",
        decode_merge=toggles.decode_merge,
        decode_io=toggles.decode_io == "fused",
        w4a16_words=toggles.w4a16_words,
        decode_use_tensor_cores=None if rt.decode_tensor_cores == "auto" else rt.decode_tensor_cores == "on",
        seed=mcfg.seed,
    )
    t0 = time.perf_counter()
    with memory.phase("kv_pool"):
        if tp is None:
            engine = Engine(model, model_cfg, ec, vision_tower=vision, ranges=ranges, memory=memory)
        else:  # model.cfg: the sharded config (per-rank KV heads); the same page count on every rank
            engine = Engine(model, model.cfg, ec, vision_tower=vision, ranges=ranges, memory=memory,
                            agree_kv_pages=lambda pages: {p: tp.min_int(pages[p]) for p in sorted(pages)})
    setup["engine_s"] = round(time.perf_counter() - t0, 3)
    memory.set_kv_pool_bytes(sum(engine.stats.kv_pool_bytes.values()))
    telemetry.start()
    return ServingTarget(
        cfg=cfg,
        model_cfg=mcfg,
        device=device,
        run_dir=run_dir,
        model=model,
        engine=engine,
        vision_tower=vision,
        memory=memory,
        ranges=ranges,
        telemetry=telemetry,
        token_space=TokenSpace.from_model_config(model_cfg),
        setup_s=setup,
        quant=_quant_info(quant, _DTYPES[mcfg.dtype], device),
        tp=tp,
        tp_summary=tp_summary(model),
    )


def _quant_info(report: Any, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
    """What ran for the weights: recorded in every scenario's `runtime.quant` and printed at load."""
    if report is None:
        return {"scheme": "bf16", "backend": "dense"}
    return {
        "scheme": report.scheme,
        "quant_backend": report.backend,
        "expert_backend": report.expert_backend,
        "quantized_bytes_before": report.quantized_bytes_before,
        "quantized_bytes_after": report.quantized_bytes_after,
        "model_bytes_after": report.model_bytes_after,
        "kept": report.kept,
        # fp8-scaled-mm: rows of M <= this take the weight-only GEMV (decode), larger M W8A8 scaled_mm
        **({"fp8_gemv_max_m": fp8_gemv_max_m(dtype, device)} if report.backend == "fp8-scaled-mm" else {}),
    }
