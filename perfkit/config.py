"""Typed, strict run configuration loaded from YAML.

A config file declares one suite: the model, the runtime settings, the toggles (code paths to A/B), the arms,
the scenarios with their workloads, what to capture and where results go. Unknown keys, wrong types and
impossible values are errors reported one line per problem with the YAML path and the allowed values; the CLI
turns them into exit code 2 without a traceback. Values measured at run time never go back into the config.

Pipeline: YAML text -> `${ENV:default}` substitution -> `--set a.b.c=value` overrides -> pydantic validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from perfkit.errors import PerfkitError

# --------------------------------------------------------------------------------------------------------------
# Toggles: named code paths switchable on a live engine. name -> (allowed values, default, what it changes).
# --------------------------------------------------------------------------------------------------------------

TOGGLES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "mask": (
        ("triton", "dense"),
        "triton",
        "multimodal sliding-layer attention mask: Triton kernel writing the packed mask from linear blob metadata "
        "(triton) vs the quadratic per-request construction then concatenation (dense)",
    ),
    "page_table": (
        ("host", "padded"),
        "host",
        "FlashInfer page-table metadata: numpy from host bookkeeping into pinned staging, one async copy, CPU "
        "indptr into plan() (host) vs padded block lists with block counts computed on the GPU and read back (padded)",
    ),
    "mm_embed_cache": (
        ("on", "off"),
        "on",
        "vision embeddings computed once per request and sliced per prefill chunk (on) vs re-encoded every chunk (off)",
    ),
    "cuda_graphs": (
        ("on", "off"),
        "on",
        "decode steps replayed from captured CUDA graphs (on) vs launched eagerly (off)",
    ),
    "fused_kernels": (
        ("auto", "on", "off"),
        "auto",
        "fused decoder layer (on): merged qkv / gate_up GEMMs, Triton RMSNorm sandwiches, GeGLU, one q/k/v norm + "
        "RoPE kernel writing K/V into the paged cache, the MoE path; vs the PyTorch ops (off); auto = on with a "
        "CUDA GPU, off on a CPU",
    ),
    "nvtx": (
        ("on", "off"),
        "on",
        "NVTX ranges with in-process host/device range timings around every engine phase (on) vs none (off); "
        "an on/off pair of arms measures the capture overhead itself",
    ),
    "overlap": (
        ("on", "off"),
        "on",
        "overlapped engine steps: the host schedules and prepares step N+1 (page tables, plan(), graph replay) while "
        "the GPU runs step N, whose sampled ids feed N+1 on the device (on), vs every step waiting for its tokens "
        "before the next is prepared (off); steps of requests that may stop on EOS always wait",
    ),
    "moe_gather": (
        ("gemv", "kernels"),
        "kernels",
        "NVFP4 MoE experts at decode sizes (bf16 activations): the gathered W4A16 gemv with the GeGLU, routing "
        "weight and combine in torch, up to 64 pairs (gemv), vs two Triton kernels that fuse them, up to 256 pairs "
        "(kernels); larger batches take the sorted grouped GEMMs either way; no effect on other experts",
    ),
    "moe_prefill": (
        ("auto", "quantized", "dequant"),
        "auto",
        "NVFP4 / FP8 MoE experts at prefill sizes (at or above QuantizedExperts.dequant_min_pairs routed pairs, 12288 "
        "= 1536 tokens at top-8): the grouped GEMMs that dequantise each weight tile in registers (quantized) vs "
        "every expert dequantised into a bf16 scratch once per layer, then the bf16 grouped GEMMs (dequant); auto: "
        "dequant for NVFP4 experts (H200 A/B), quantized for FP8 experts (their dequant lost at every size timed); "
        "no effect on other experts",
    ),
    "decode_attention": (
        ("auto", "flashinfer", "triton"),
        "auto",
        "the decode rows' attention kernel under attention=flashinfer: FlashInfer's decode (flashinfer) vs perfkit's "
        "split-KV Triton kernel, many programs per request so small batches read the pages at bandwidth, then a "
        "merge of the splits (triton); auto = triton up to TRITON_DECODE_MAX_BATCH decode rows, flashinfer above; "
        "no effect with attention=torch",
    ),
    "decode_gemv": (
        ("auto", "cublas", "triton"),
        "auto",
        "batch-1 decode's bf16 / fp16 linears (one row of x) on the fused path: cuBLAS (cublas) vs perfkit's Triton "
        "gemv, which streams each weight row once with no split-K (triton); auto = per weight shape, whichever was "
        "faster when the engine timed both on the model's own weights at start (CUDA only; the timings go into the "
        "result's runtime.decode_gemv); no effect with fused_kernels off or on quantised linears",
    ),
    "pdl": (
        ("auto", "on", "off"),
        "auto",
        "programmatic dependent launch (sm_90+): the fused path's Triton kernels, the Triton decode attention and "
        "the quantised linears' batch-1 kernels (W4A16 gemv, FP8 GEMV) launch so that each may start while the "
        "kernel before it drains, waiting on the device for its inputs "
        "(on), vs plain launches (off); the same kernels and arithmetic, so the tokens are identical; auto = on "
        "where the GPU supports it; cuBLAS, FlashInfer and torch kernels always launch plainly",
    ),
    "decode_fusion": (
        ("on", "off"),
        "on",
        "batch-1 decode on the fused path in fewer launches per layer, each bit-identical to what it replaces (on): "
        "the down gemv applies GeGLU as it loads the gate_up output (no gelu_mul kernel; decode_gemv=auto keeps it "
        "to the down shapes where it timed faster), and the 26B-A4B router's product shares the dense gate_up's gemv "
        "launch; vs one launch each (off); the tokens are identical; no effect with fused_kernels off, above one "
        "decode row, or on shapes decode_gemv leaves to cuBLAS",
    ),
    "decode_routing": (
        ("separate", "fused"),
        "fused",
        "MoE layers at batch 1 with decode_fusion on: the routing (softmax, top-k) as its own kernel (separate), or "
        "as one more program of the dense MLP's down gemv launch, which does not depend on it (fused; where the down "
        "product is a gemv); the routing weights agree to fp32 rounding (the softmax sums in another order), "
        "the expert ids and tokens matched in every test; no effect on dense models; fused by default since 12-09 "
        "(26B-A4B c1 TPOT 2.998 -> 2.921 ms on the H200)",
    ),
    "decode_moe_ffn": (
        ("separate", "fused", "branches"),
        "branches",
        "26B-A4B MoE layers with fused_kernels and decode_fusion on: the feed-forward block at batch 1 in five "
        "launches in a row after the attention sandwich (separate: dense gate_up + router, dense down + routing, "
        "the experts' gate_up, the experts' down), in two (fused: the router's product in the sandwich's launch, "
        "the dense and expert gate_up in one launch that routes in every expert program, the dense and expert down "
        "in another; perfkit/kernels/moe_ffn.py), or, at steps of up to 32 rows, on two CUDA-graph branches "
        "(branches: the router's product in the sandwich's launch, the dense MLP on a second stream while the "
        "routing and the experts run on the first, so each branch's launches overlap the other's); the same "
        "weights read; the router's sums run in another order (and fused's dense branch rounds once instead of "
        "twice), so the arms agree to rounding, not bit for bit; branches by default since 12-12 (26B-A4B c1 TPOT "
        "2.896 -> 2.750 ms, c4 5.75 -> 5.24 ms on the H200; up to 32 rows since 12-13: c16 -4.8 %, c32 -3.8 %)",
    ),
    "decode_prologue": (
        ("separate", "fused"),
        "separate",
        "decode-only steps on the Triton decode attention with fused_kernels on: q/k norm + RoPE, v_norm and the "
        "newest K / V row's cache write in their own launch (separate), or inside the decode kernel, whose programs "
        "norm and rope their own query heads and use the newest row from registers (fused); the same fp32 "
        "arithmetic and roundings, bit for bit under the interpreter; no effect on mixed steps, on FlashInfer's "
        "decode or with attention=torch; separate by default: fused was slower on the H200 (12-10: 26B-A4B c1 TPOT "
        "2.912 -> 2.934 ms, c4 +2 %; it gains on the sliding pools at batch 1 and loses on the hd 512 full pools)",
    ),
    "decode_merge": (
        ("launch", "fused"),
        "launch",
        "the Triton decode attention's merge of its split-KV slices: a launch of its own (launch), or, where the "
        "merge is small (group x splits x head_dim <= 16K elements: the sliding pools at small batches), done in the "
        "decode launch by the slice of each (row, kv head) that finishes last (fused; an atomic counter per pair, "
        "the split-K sum of the tensor-core gemv); the same tiles and sums; no effect on FlashInfer's decode or with "
        "attention=torch; launch by default: fused was slower on the H200 (12-19: 26B-A4B c1 TPOT 2.761 -> 2.908 "
        "ms, c4 +1.2 %, 31B c1 16.23 -> 16.52 ms, c4 +1.8 %)",
    ),
    "decode_io": (
        ("separate", "fused"),
        "fused",
        "decode steps replayed from CUDA graphs: the step's inputs sent by five uploads and copied into the graph's "
        "static buffers, the previous step's sampled ids gathered by two launches, the token embedding rows "
        "(placeholders to pad, the sqrt(H) scale) and both RoPE tables' rows written by ~18 torch launches, and the "
        "logits soft-capped by four and their argmax taken by the sampler (separate), vs one upload to addresses the "
        "graph captured, one launch at the graph's start for the rows and the gather, and one at its end that "
        "soft-caps and writes each row's argmax (fused; perfkit/kernels/decode_io.py, perfkit/runtime/"
        "graph_inputs.py); the same values bit for bit; the upload and the rows launch only with page_table=host, on "
        "models without per-layer inputs and not under tensor parallelism; no effect with cuda_graphs off; fused by "
        "default since 12-20 (H200: 26B-A4B c1 TPOT 2.769 -> 2.669 ms, 31B c1 16.28 -> 16.17 ms)",
    ),
    "w4a16_words": (
        ("auto", "standard", "repacked"),
        "auto",
        "NVFP4 weights on the W4A16 path (Hopper): each int32 word's codes in the checkpoint's bit order (standard), "
        "or permuted once at engine start (repacked: the tensor-core batch-1 gemv then decodes a pair of codes with "
        "one rotation and one mask instead of two shifts and two masks), or repacked only where the batch-1 product "
        "runs the tensor-core gemv in one wave of programs (auto: 4.8-7.2 % faster there, 1.6-3.7 % slower on more "
        "waves, H200 12-17); rewritten in place, the same codes and sums: bit for bit; no effect on other formats",
    ),
    "attention": (
        ("auto", "flashinfer", "torch"),
        "auto",
        "attention backend: FlashInfer paged kernels (GPU) vs the torch reference (pages gathered back, explicit "
        "mask, SDPA; CPU and GPU); auto = flashinfer when a CUDA GPU and flashinfer are present, else torch",
    ),
}


def _strict() -> ConfigDict:
    return ConfigDict(extra="forbid", frozen=True)


def _yaml_on_off(value: Any) -> Any:
    # YAML 1.1 reads `on`/`off` as booleans; toggles spell them as strings.
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


class Toggles(BaseModel):
    """Values of the toggles; every field is one of TOGGLES' allowed values."""

    model_config = _strict()

    mask: Literal["triton", "dense"] = "triton"
    page_table: Literal["host", "padded"] = "host"
    mm_embed_cache: Literal["on", "off"] = "on"
    cuda_graphs: Literal["on", "off"] = "on"
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    nvtx: Literal["on", "off"] = "on"
    overlap: Literal["on", "off"] = "on"
    moe_gather: Literal["gemv", "kernels"] = "kernels"
    moe_prefill: Literal["auto", "quantized", "dequant"] = "auto"
    decode_attention: Literal["auto", "flashinfer", "triton"] = "auto"
    decode_gemv: Literal["auto", "cublas", "triton"] = "auto"
    pdl: Literal["auto", "on", "off"] = "auto"
    decode_fusion: Literal["on", "off"] = "on"
    decode_routing: Literal["separate", "fused"] = "fused"
    decode_moe_ffn: Literal["separate", "fused", "branches"] = "branches"
    decode_prologue: Literal["separate", "fused"] = "separate"
    decode_merge: Literal["launch", "fused"] = "launch"
    decode_io: Literal["separate", "fused"] = "fused"
    w4a16_words: Literal["auto", "standard", "repacked"] = "auto"
    attention: Literal["auto", "flashinfer", "torch"] = "auto"

    @field_validator("mm_embed_cache", "cuda_graphs", "fused_kernels", "nvtx", "overlap", "pdl", "decode_fusion",
                     mode="before")  # fmt: skip
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        return _yaml_on_off(value)


class PartialToggles(BaseModel):
    """Toggle overrides of one arm: only the toggles the arm changes."""

    model_config = _strict()

    mask: Literal["triton", "dense"] | None = None
    page_table: Literal["host", "padded"] | None = None
    mm_embed_cache: Literal["on", "off"] | None = None
    cuda_graphs: Literal["on", "off"] | None = None
    fused_kernels: Literal["auto", "on", "off"] | None = None
    nvtx: Literal["on", "off"] | None = None
    overlap: Literal["on", "off"] | None = None
    moe_gather: Literal["gemv", "kernels"] | None = None
    moe_prefill: Literal["auto", "quantized", "dequant"] | None = None
    decode_attention: Literal["auto", "flashinfer", "triton"] | None = None
    decode_gemv: Literal["auto", "cublas", "triton"] | None = None
    pdl: Literal["auto", "on", "off"] | None = None
    decode_fusion: Literal["on", "off"] | None = None
    decode_routing: Literal["separate", "fused"] | None = None
    decode_moe_ffn: Literal["separate", "fused", "branches"] | None = None
    decode_prologue: Literal["separate", "fused"] | None = None
    decode_merge: Literal["launch", "fused"] | None = None
    decode_io: Literal["separate", "fused"] | None = None
    w4a16_words: Literal["auto", "standard", "repacked"] | None = None
    attention: Literal["auto", "flashinfer", "torch"] | None = None

    @field_validator("mm_embed_cache", "cuda_graphs", "fused_kernels", "nvtx", "overlap", "pdl", "decode_fusion",
                     mode="before")  # fmt: skip
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        return _yaml_on_off(value)


class Arm(BaseModel):
    """One side of an A/B comparison: a name and the toggles it sets on top of the suite's toggles."""

    model_config = _strict()

    name: str = Field(min_length=1)
    toggles: PartialToggles = PartialToggles()


# --------------------------------------------------------------------------------------------------------------
# Model and runtime
# --------------------------------------------------------------------------------------------------------------

MODEL_PRESETS = ("e2b", "e4b", "26b-a4b", "31b", "tiny", "tiny-31b", "tiny-moe", "tiny-e2b", "tiny-e4b")


class ModelConfig(BaseModel):
    """Which Gemma4 to build and how: a preset at exact shapes or an HF checkpoint directory."""

    model_config = _strict()

    preset: Literal["e2b", "e4b", "26b-a4b", "31b", "tiny", "tiny-31b", "tiny-moe", "tiny-e2b", "tiny-e4b"] | None = (
        "tiny"
    )
    path: str | None = None
    weights: Literal["random", "hf"] = "random"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    quant: Literal["bf16", "fp8", "nvfp4"] = "bf16"
    num_layers: int | None = Field(default=None, ge=1, description="truncate to N layers keeping the pattern")
    sliding_window: int | None = Field(default=None, ge=1, description="override the preset's sliding window")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _source(self) -> ModelConfig:
        if self.weights == "hf" and not self.path:
            raise ValueError("weights: hf needs model.path (a directory with config.json + *.safetensors)")
        if self.path is None and self.preset is None:
            raise ValueError("set model.preset (one of " + ", ".join(MODEL_PRESETS) + ") or model.path")
        return self


class RuntimeConfig(BaseModel):
    """Engine settings that are not A/B toggles."""

    model_config = _strict()

    page_size: int = Field(default=16, ge=1, le=1024)
    kv_cache_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    max_batch_size: int = Field(default=256, ge=1)
    max_num_tokens: int = Field(default=8192, ge=1, description="token budget of one engine step")
    max_model_len: int = Field(default=32768, ge=1, description="longest context a request may reach")
    decode_tensor_cores: Literal["auto", "on", "off"] = Field(
        default="auto", description="flashinfer decode on tensor cores; auto = by pool and batch size, as measured"
    )
    tensor_parallel: int = Field(
        default=1, ge=1, description="TP ranks (one GPU each) launched through torchrun; `perfkit run --tp N` overrides"
    )


# --------------------------------------------------------------------------------------------------------------
# Workloads and arrivals
# --------------------------------------------------------------------------------------------------------------


class LengthDist(BaseModel):
    """A token-length distribution. `fixed` ignores the spread fields; results are clipped to [min, max]."""

    model_config = _strict()

    dist: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: int = Field(ge=1)
    range_ratio: float = Field(default=0.0, ge=0.0, le=1.0, description="uniform: [mean*(1-r), mean*(1+r)]")
    std: float = Field(default=0.0, ge=0.0, description="normal: standard deviation in tokens")
    sigma: float = Field(default=0.0, ge=0.0, description="lognormal: sigma of log(length); median = mean")
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> LengthDist:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    def upper_bound(self) -> int:
        """Largest length this distribution can produce (used to check the workload fits the context)."""
        if self.max is not None:
            return self.max
        if self.dist == "fixed":
            return self.mean
        if self.dist == "uniform":
            return int(round(self.mean * (1 + self.range_ratio)))
        return 1 << 62  # unbounded tails: clipped only by max


def _length(value: Any) -> Any:
    return {"mean": value} if isinstance(value, int) and not isinstance(value, bool) else value


class ImagesSpec(BaseModel):
    """Images per request, each `boi + tokens_per_image x <image> + eoi`."""

    model_config = _strict()

    count: int = Field(ge=1)
    tokens_per_image: Literal[70, 140, 280, 560, 1120] = 280


class VideoSpec(BaseModel):
    """Video frames per request, each frame `mm:ss boi + tokens_per_frame x <video> + eoi`."""

    model_config = _strict()

    frames: int = Field(ge=1)
    tokens_per_frame: Literal[70, 140, 280] = 70


class WorkloadConfig(BaseModel):
    """Synthetic requests of one scenario. isl/osl: an int (fixed) or a LengthDist."""

    model_config = _strict()

    isl: LengthDist | None = None
    osl: LengthDist
    dataset: str | None = Field(default=None, description="JSONL of {input_ids | input_len, output_len}")
    shared_prefix_len: int = Field(default=0, ge=0)
    images: ImagesSpec | None = None
    video: VideoSpec | None = None
    seed: int = 0

    _coerce_isl = field_validator("isl", "osl", mode="before")(lambda cls, v: _length(v))

    @model_validator(mode="after")
    def _source(self) -> WorkloadConfig:
        if self.isl is None and self.dataset is None:
            raise ValueError("set isl (text tokens per request) or dataset")
        if self.isl is not None and self.dataset is not None:
            raise ValueError("set isl or dataset, not both (a dataset line carries its own input length)")
        return self


class ClosedLoop(BaseModel):
    """Fixed concurrency: a new request is submitted when one finishes; never more than C in flight."""

    model_config = _strict()

    kind: Literal["closed"] = "closed"
    concurrency: int = Field(ge=1)


class OpenLoop(BaseModel):
    """Requests arrive at `rate` per second; gamma inter-arrivals with shape `burstiness` (1.0 = Poisson)."""

    model_config = _strict()

    kind: Literal["rate"] = "rate"
    rate: float = Field(gt=0.0, description="requests per second")
    burstiness: float = Field(default=1.0, gt=0.0)


class AllAtOnce(BaseModel):
    """Every request submitted at t=0 (offline throughput)."""

    model_config = _strict()

    kind: Literal["all_at_once"] = "all_at_once"


Arrival = Annotated[Union[ClosedLoop, OpenLoop, AllAtOnce], Field(discriminator="kind")]


class SLO(BaseModel):
    """Service-level objectives for goodput: a request is good when it meets every one given."""

    model_config = _strict()

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


class ScenarioConfig(BaseModel):
    """One measured scenario: a workload driven by an arrival process, with limits and optional SLOs."""

    model_config = _strict()

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    workload: WorkloadConfig
    arrival: Arrival = ClosedLoop(concurrency=1)
    num_requests: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0)
    warmup_requests: int = Field(default=0, ge=0)
    slo: SLO | None = None
    runner: Literal["engine", "hf"] = "engine"
    models: list[str] | None = Field(
        default=None, min_length=1,
        description="the suite's model names this scenario runs on (a several-model suite: the preset, or the "
        "checkpoint folder's name); default: every model",
    )  # fmt: skip

    @field_validator("arrival", mode="before")
    @classmethod
    def _default_kind(cls, value: Any) -> Any:
        # `arrival: {concurrency: 8}` means a closed loop; the tag is only needed for the other kinds.
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": "closed", **value}
        return value

    @model_validator(mode="after")
    def _limits(self) -> ScenarioConfig:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("set num_requests and/or duration_s")
        if self.runner == "hf":
            if self.arrival.kind == "rate":
                raise ValueError("runner hf serves static batches: use arrival closed or all_at_once, not rate")
            if self.workload.images is not None or self.workload.video is not None:
                raise ValueError("runner hf runs text workloads only (no images/video)")
            if self.num_requests is None:
                raise ValueError("runner hf needs num_requests")
        if self.arrival.kind == "all_at_once" and self.num_requests is None:
            raise ValueError("arrival all_at_once needs num_requests (how many to submit at t=0)")
        return self


# --------------------------------------------------------------------------------------------------------------
# Capture and output
# --------------------------------------------------------------------------------------------------------------


class CaptureConfig(BaseModel):
    """What to record beyond serving metrics."""

    model_config = _strict()

    nvtx: bool = True
    per_layer_nvtx: bool = False
    device_timing: bool = True
    memory: bool = True
    telemetry: bool = True
    telemetry_interval_ms: int = Field(default=100, ge=10)
    sync_counts: bool = False  # device syncs per engine phase (torch sync debug mode; perturbs timing: opt-in)
    profile: Literal["none", "torch", "cuda", "python"] = "none"
    profile_scenario: str | None = None
    profile_steps: tuple[int, int] = (10, 20)

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] < 0 or value[1] <= value[0]:
            raise ValueError(f"profile_steps must be [start, stop) with 0 <= start < stop (got {list(value)})")
        return value


class OutputConfig(BaseModel):
    model_config = _strict()

    dir: str = "results"
    label: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]+$")


def model_names(models: Sequence[tuple[str | None, str | None]]) -> list[str]:
    """The suite's name for each (preset, path) model: the preset or the checkpoint folder's name, with its
    index appended to all when two would share one ("31b-0", "31b-1"). Scenario results of a several-model
    suite are named "<model name>/<scenario>"."""
    names = [preset or Path(path or "model").name for preset, path in models]
    if len(set(names)) != len(names):
        names = [f"{n}-{i}" for i, n in enumerate(names)]
    return names


class RunConfig(BaseModel):
    """A whole suite: scenarios x arms x repeats on one loaded model."""

    model_config = _strict()

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    model: ModelConfig = ModelConfig()
    models: list[ModelConfig] = Field(
        default_factory=list, description="several models run one after another; overrides `model`"
    )
    runtime: RuntimeConfig = RuntimeConfig()
    toggles: Toggles = Toggles()
    arms: list[Arm] = Field(default_factory=list, description="A/B arms; empty = one arm with `toggles`")
    repeats: int = Field(default=1, ge=1, description="repeats per arm, interleaved A B A B")
    scenarios: list[ScenarioConfig] = Field(min_length=1)
    capture: CaptureConfig = CaptureConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        names = [s.name for s in self.scenarios]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"scenario names must be unique (repeated: {', '.join(dup)})")
        arm_names = [a.name for a in self.arms]
        if len(set(arm_names)) != len(arm_names):
            raise ValueError("arm names must be unique")
        model_names_ = [n for n, _ in self.model_list()]
        for s in self.scenarios:
            unknown = [m for m in s.models or [] if m not in model_names_]
            if unknown:
                raise ValueError(f"scenario {s.name}: models {', '.join(unknown)} are not in the suite; "
                                 f"allowed: {', '.join(model_names_)}")  # fmt: skip
        max_len = self.runtime.max_model_len
        for where, m in [("model", self.model)] + [(f"models[{i}]", m) for i, m in enumerate(self.models)]:
            if m.sliding_window is not None and m.sliding_window > max_len:
                raise ValueError(
                    f"{where}.sliding_window ({m.sliding_window}) is larger than the context "
                    f"runtime.max_model_len ({max_len}); use a window <= max_model_len"
                )
        for i, s in enumerate(self.scenarios):
            w = s.workload
            if w.isl is None:
                continue
            mm = 0
            if w.images is not None:
                mm += w.images.count * (w.images.tokens_per_image + 2)
            if w.video is not None:
                mm += w.video.frames * (w.video.tokens_per_frame + 6)
            need = w.shared_prefix_len + w.isl.upper_bound() + mm + w.osl.upper_bound()
            if need > max_len and need < (1 << 61):
                raise ValueError(
                    f"scenarios[{i}] ({s.name}) needs up to {need} tokens of context (prefix + isl + images + osl) "
                    f"but runtime.max_model_len is {max_len}; raise max_model_len or shorten the workload"
                )
        if self.capture.profile_scenario is not None and self.capture.profile_scenario not in names:
            raise ValueError(
                f"capture.profile_scenario '{self.capture.profile_scenario}' is not a scenario; "
                f"allowed: {', '.join(names)}"
            )
        return self

    def model_list(self) -> list[tuple[str, ModelConfig]]:
        """(name, model) pairs; the name prefixes scenario names when several models run in one suite."""
        models = self.models or [self.model]
        return list(zip(model_names([(m.preset, m.path) for m in models]), models, strict=True))

    def scenarios_of(self, model_name: str, runner: str) -> list[ScenarioConfig]:
        """The scenarios a model runs with a runner, in suite order (a scenario's `models` narrows them)."""
        return [s for s in self.scenarios if s.runner == runner and (s.models is None or model_name in s.models)]

    def arm_list(self) -> list[tuple[str, Toggles]]:
        """Resolved arms: (name, full toggles). No arms declared = one arm named 'default'."""
        if not self.arms:
            return [("default", self.toggles)]
        out = []
        for arm in self.arms:
            changes = {k: v for k, v in arm.toggles.model_dump().items() if v is not None}
            out.append((arm.name, self.toggles.model_copy(update=changes)))
        return out


# --------------------------------------------------------------------------------------------------------------
# Loading: env substitution, --set overrides, validation with one-line errors
# --------------------------------------------------------------------------------------------------------------

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def substitute_env(node: Any, environ: typing.Mapping[str, str] | None = None) -> Any:
    """Replace `${NAME:default}` in string values. A value that is only a placeholder is re-read as YAML so
    `${BS:64}` becomes the int 64. A variable that is unset and has no default is an error."""
    env = os.environ if environ is None else environ
    if isinstance(node, dict):
        return {k: substitute_env(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute_env(v, env) for v in node]
    if not isinstance(node, str) or "${" not in node:
        return node

    def repl(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is None:
            raise PerfkitError(f"config: environment variable {name} is not set and ${{{name}}} has no default")
        return default

    whole = _ENV.fullmatch(node)
    text = _ENV.sub(repl, node)
    return yaml.safe_load(text) if whole and text != "" else text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value read as YAML; list items addressed by index: `scenarios.0.name=x`)."""
    for item in overrides:
        if "=" not in item:
            raise PerfkitError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. runtime.max_batch_size=64")
        path, _, text = item.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise PerfkitError(f"--set {item!r}: empty key path")
        value = yaml.safe_load(text) if text.strip() else ""
        node: Any = raw
        for depth, key in enumerate(keys):
            last = depth == len(keys) - 1
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise PerfkitError(
                        f"--set {path}: '{key}' is not an index of {'.'.join(keys[:depth]) or 'the list'} "
                        f"(0..{len(node) - 1})"
                    )
                if last:
                    node[int(key)] = value
                else:
                    node = node[int(key)]
            elif isinstance(node, dict):
                if last:
                    node[key] = value
                else:
                    node = node.setdefault(key, {})
            else:
                raise PerfkitError(f"--set {path}: '{'.'.join(keys[:depth])}' is a value, not a section")
    return raw


def _loc_to_path(cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, type[BaseModel] | None]:
    """Turn a pydantic error location into a YAML path (`scenarios[0].arrival.concurrency`), dropping the
    discriminator tags pydantic inserts, and return the model class that owns the last key."""
    parts: list[str] = []
    model: Any = cls
    owner: type[BaseModel] | None = cls
    ann: Any = None
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            ann = _unwrap_list(ann)
            model = _as_model(ann)
            continue
        if model is None:
            # inside a discriminated union the tag comes first; pick the member it names
            member = _union_member(ann, item)
            if member is not None:
                model = member
                continue
            parts.append(("." if parts else "") + str(item))
            continue
        owner = model
        field = model.model_fields.get(item)
        if field is None:
            member = _union_member(ann, item)
            if member is not None:
                model = member
                continue
            parts.append(("." if parts else "") + str(item))
            model = None
            continue
        parts.append(("." if parts else "") + str(item))
        ann = field.annotation
        model = _as_model(ann)
    return "".join(parts), owner


def _strip_optional(ann: Any) -> Any:
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _strip_optional(typing.get_args(ann)[0])
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return _strip_optional(args[0])
    return ann


def _unwrap_list(ann: Any) -> Any:
    ann = _strip_optional(ann)
    if typing.get_origin(ann) in (list, tuple):
        args = typing.get_args(ann)
        return args[0] if args else None
    return ann


def _as_model(ann: Any) -> type[BaseModel] | None:
    ann = _strip_optional(ann)
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _union_member(ann: Any, tag: Any) -> type[BaseModel] | None:
    ann = _strip_optional(ann)
    for arg in typing.get_args(ann):
        arg = _strip_optional(arg)
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            kind = arg.model_fields.get("kind")
            if kind is not None and kind.default == tag:
                return arg
    return None


def format_validation_error(err: ValidationError, source: str, cls: type[BaseModel] = RunConfig) -> list[str]:
    """One line per problem: `<source>: <yaml.path>: <what is wrong> (<allowed values / got>)`."""
    lines = []
    for e in err.errors(include_url=False):
        path, owner = _loc_to_path(cls, tuple(e["loc"]))
        kind = e["type"]
        msg = e["msg"]
        got = e.get("input")
        if kind == "extra_forbidden":
            allowed = ", ".join(owner.model_fields) if owner is not None else "see `perfkit config schema`"
            msg = f"unknown key; allowed keys here: {allowed}"
        elif kind == "literal_error":
            msg = f"{msg} (got {got!r})"
        elif kind == "union_tag_invalid":
            msg = f"{msg}"
        elif kind == "missing":
            msg = "required key is missing"
        elif kind.startswith(("greater_than", "less_than", "int_", "float_", "string_", "bool_", "too_short")):
            msg = f"{msg} (got {got!r})"
        elif kind == "value_error":
            msg = msg.removeprefix("Value error, ")
        lines.append(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")
    return lines


def parse_config(raw: Any, source: str = "<config>") -> RunConfig:
    if not isinstance(raw, dict):
        raise PerfkitError(f"{source}: the top level must be a mapping of keys (name, model, scenarios, ...)")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise PerfkitError("\n".join(format_validation_error(err, source))) from None


def load_config(
    path: str | Path, overrides: list[str] | None = None, environ: typing.Mapping[str, str] | None = None
) -> RunConfig:
    """Read, substitute, override and validate a config file."""
    p = Path(path)
    if not p.is_file():
        raise PerfkitError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise PerfkitError(f"{p}:{where}: not valid YAML: {problem}") from None
    cfg = load_raw(raw if raw is not None else {}, str(p), overrides, environ)
    return _resolve_paths(cfg, p.parent)


def _resolve_paths(cfg: RunConfig, base: Path) -> RunConfig:
    """A relative dataset or checkpoint path that exists beside the config file means that one; otherwise it is
    left relative to the working directory (the usual meaning for `--set model.path=...`)."""

    def fix(path: str | None) -> str | None:
        if path and not Path(path).is_absolute() and (base / path).exists():
            return str((base / path).resolve())
        return path

    scenarios = [
        s.model_copy(update={"workload": s.workload.model_copy(update={"dataset": fix(s.workload.dataset)})})
        for s in cfg.scenarios
    ]
    model = cfg.model.model_copy(update={"path": fix(cfg.model.path)})
    models = [m.model_copy(update={"path": fix(m.path)}) for m in cfg.models]
    return cfg.model_copy(update={"scenarios": scenarios, "model": model, "models": models})


def load_raw(
    raw: Any,
    source: str,
    overrides: list[str] | None = None,
    environ: typing.Mapping[str, str] | None = None,
) -> RunConfig:
    raw = substitute_env(raw, environ)
    if overrides:
        if not isinstance(raw, dict):
            raise PerfkitError(f"{source}: the top level must be a mapping")
        raw = apply_overrides(raw, overrides)
    return parse_config(raw, source)


def config_schema() -> dict[str, Any]:
    """JSON Schema of the run config, for editors validating YAML."""
    schema = RunConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "perfkit run config"
    return schema


def stable_hash(obj: Any) -> str:
    """Short content hash of a JSON-able object (workload identity across runs)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
