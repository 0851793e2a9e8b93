"""Serving engine: paged KV cache, continuous batching with chunked prefill, torch / FlashInfer attention, CUDA
graphs for decode. One `step()` = schedule -> prepare -> forward -> sample -> resolve -> postprocess.

Overlapped steps (toggle overlap=on): `sample` only launches the sampling and an async copy of the ids to the
host; the step then resolves the PREVIOUS step's ids (waiting for them while the GPU already has this step queued)
and advances the scheduler with placeholders for its own, which the next step resolves. So the host's schedule /
prepare / plan() / launch of step N+1 runs while the GPU computes step N, and step N+1's decodes read their input
ids from step N's sampled ids on the device. A step whose requests may stop on EOS (ignore_eos off) resolves its
own ids before returning, since its successor's batch depends on them. A token's `t_host_ns` is taken when its
ids are on the host, in either mode.

Toggles (settable on a live engine with `set_toggle`; both arms of every toggle give identical tokens):
  attention=flashinfer|torch   page_table=host|padded   mask=triton|dense   mm_embed_cache=on|off
  cuda_graphs=on|off (decode graphs; only with a backend that supports them, i.e. flashinfer)   overlap=on|off
  decode_attention=auto|flashinfer|triton (the decode rows' kernel under attention=flashinfer; rounding-level)
  decode_gemv=auto|cublas|triton (batch-1 decode's linears on the fused path: cuBLAS or perfkit's gemv;
  rounding-level)   pdl=on|off (the fused path's, the Triton decode's and the quantised linears' batch-1 kernels
  launch with programmatic dependent launch, sm_90+; the same kernels and arithmetic, so bit for bit)
  decode_fusion=on|off (fewer launches per batch-1 decode layer: GeGLU inside the down gemv, the MoE router beside
  the dense gate_up in one gemv launch; bit for bit)
  decode_routing=separate|fused (with decode_fusion: the MoE routing as one more program of the dense down gemv's
  launch; the routing weights to fp32 rounding)
  decode_moe_ffn=separate|fused|branches (with decode_fusion: a MoE layer's feed-forward block at decode; fused: at
  batch 1 in two launches, the router's product in the attention sandwich's; branches: up to 32 rows, the dense MLP
  on a second CUDA stream beside the routing and the experts, the router's product in the sandwich's launch;
  rounding-level: the router's sums run in another order, and fused's dense branch rounds once)
  decode_prologue=separate|fused (fused_kernels on, decode-only steps on the Triton decode: the q/k norm + RoPE and
  the newest K / V row's write inside the decode kernel instead of their own launch; the same arithmetic, bit for
  bit under the interpreter, a q element an ulp apart now and then on the GPU)
  decode_merge=launch|fused (the Triton decode's merge of its split-KV slices in a launch of its own, or, where it is
  small, by the last slice of each (row, kv head) in the decode launch; the same tiles and sums: bit for bit with bf16
  caches, an ulp apart at times with fp8 ones)
  decode_io=separate|fused (CUDA-graph decode steps: the step's inputs in one upload read in place by the graph, the
  embedding and RoPE rows and the previous ids' gather as its first launch, the soft-cap writing each row's argmax
  as its last, which the sampler takes; bit for bit)
  w4a16_words=auto|standard|repacked (NVFP4 weights' words in the checkpoint's bit order or repacked, which the
  tensor-core gemv decodes with fewer instructions; auto: where the batch-1 product is faster so; bit for bit)
Three toggles change the arithmetic's order, so their arms agree to rounding rather than bit for bit:
  fused_kernels=on|off   moe_gather=gemv|kernels (NVFP4 experts at decode sizes; no effect on other models)
  moe_prefill=auto|quantized|dequant (NVFP4 / FP8 experts at prefill sizes; no effect on other models)
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from perfkit.errors import PerfkitError
from perfkit.runtime.block_manager import BlockManager
from perfkit.runtime.kv_cache import KVScales, PagedKVCache, plan_kv_pages, pool_specs, rmsnorm_bound_kv_scales
from perfkit.runtime.model_runner import ModelRunner
from perfkit.runtime.page_table import make_page_table_builder
from perfkit.runtime.sampling import TokenTransfer, sample_on_device
from perfkit.runtime.scheduler import Request, SampledSlot, SamplingParams, Scheduler, StepOutput

__all__ = ["Engine", "EngineConfig", "EngineStats", "StepOutput", "SamplingParams", "TOGGLES"]

TOGGLES = {
    "attention": ("flashinfer", "torch"),
    "page_table": ("host", "padded"),
    "mask": ("triton", "dense"),
    "mm_embed_cache": ("on", "off"),
    "cuda_graphs": ("on", "off"),
    "fused_kernels": ("on", "off"),
    "nvtx": ("on", "off"),
    "overlap": ("on", "off"),
    "moe_gather": ("gemv", "kernels"),
    "moe_prefill": ("auto", "quantized", "dequant"),
    "decode_attention": ("auto", "flashinfer", "triton"),
    "decode_gemv": ("auto", "cublas", "triton"),
    "pdl": ("on", "off"),
    "decode_fusion": ("on", "off"),
    "decode_routing": ("separate", "fused"),
    "decode_moe_ffn": ("separate", "fused", "branches"),
    "decode_prologue": ("separate", "fused"),
    "decode_merge": ("launch", "fused"),
    "decode_io": ("separate", "fused"),
    "w4a16_words": ("auto", "standard", "repacked"),
}
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}  # fmt: skip
_CPU_KV_BUDGET_BYTES = 1 << 30  # no memory probe on CPU: a fixed budget before kv_cache_fraction


@dataclass(frozen=True)
class EngineConfig:
    attention: str = "torch"  # flashinfer | torch
    page_size: int = 16
    kv_cache_fraction: float = 0.9  # of the free memory measured after weights + a warmup forward
    max_images_per_encode: int = 8  # vision-tower batch cap: its activations live in the KV sizing's headroom
    max_batch_size: int = 64
    max_num_tokens: int = 8192  # new tokens per step (decodes + prefill chunks)
    max_model_len: int = 32768  # longest prompt + output; sizes RoPE tables captured by graphs
    kv_dtype: str = "auto"  # auto = the model's dtype (bf16 on the GPU); bfloat16 | float16 | float32 | fp8 (e4m3,
    # per-cache-layer K/V scales from the RMSNorm bound, see kv_cache.py)
    cuda_graphs: bool = True
    page_table: str = "host"  # host | padded
    mask: str = "triton"  # triton | dense
    mm_embed_cache: bool = True
    fused_kernels: bool = False  # Triton RMSNorm / GeGLU / QK-norm+RoPE / MoE instead of the PyTorch ops
    overlap: bool = True  # prepare step N+1 on the host while the GPU runs step N (see the module docstring)
    moe_gather: str = "kernels"  # gemv | kernels: NVFP4 experts at decode sizes (Gemma4ForCausalLM.set_moe_gather)
    moe_prefill: str = "auto"  # auto | quantized | dequant: quantised experts at prefill sizes (set_moe_prefill)
    num_kv_pages: int | None = None  # override: pages per pool (tests); else kv_cache_bytes; else measured
    kv_cache_bytes: int | None = None  # override: KV budget in bytes (before the split between pools)
    decode_use_tensor_cores: bool | None = None  # flashinfer decode; None = by pool and batch (measured rule)
    decode_attention: str = "auto"  # auto | flashinfer | triton: the decode rows' kernel (attention=flashinfer)
    decode_gemv: str = "cublas"  # auto | cublas | triton: one-row linears (Gemma4ForCausalLM.set_decode_gemv)
    pdl: bool = False  # Triton kernels launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+)
    decode_fusion: bool = False  # fewer launches per batch-1 decode layer (Gemma4ForCausalLM.set_decode_fusion)
    decode_routing: bool = False  # with decode_fusion: MoE routing in the down gemv's launch (set_decode_fusion)
    decode_moe_ffn: str = "separate"  # with decode_fusion: a MoE layer's FFN block, separate | fused | branches
    decode_prologue: bool = False  # q/k norm + RoPE + the new K / V row inside the Triton decode (attend_raw)
    decode_merge: str = "launch"  # launch | fused: the Triton decode's merge of its slices (paged_decode)
    decode_io: bool = False  # graph decode steps' inputs and soft-cap + argmax in one launch each (decode_io.py)
    w4a16_words: str = "standard"  # auto | standard | repacked: NVFP4 weights' word order (set_w4a16_words)
    workspace_bytes: int = 256 << 20  # flashinfer float workspace, shared by every wrapper
    seed: int = 0  # sampling generators


class NullCapture:
    """Stands in for the capture instruments (perfkit.capture: RangeRecorder, MemoryTracker) when none are given:
    `range(name)` and `phase(name)` are shared no-op contexts. The runtime never imports perfkit.capture."""

    _null = contextlib.nullcontext()

    def range(self, name: str) -> Any:
        return self._null

    def phase(self, name: str) -> Any:
        return self._null


NULL_CAPTURE = NullCapture()


@dataclass
class _Launched:
    """A step whose sampled ids are on their way to the host."""

    ids: torch.Tensor  # device int64 [S]: the next step's decodes read their input ids here
    ticket: tuple[int, int]  # TokenTransfer ticket
    deferrable: bool  # may the next step be scheduled before these ids are known (Engine._defer)
    slots: list[SampledSlot] = field(default_factory=list)  # where the ids go (scheduler.advance)


@dataclass
class EngineStats:
    preemptions: int = 0
    kv_pages: dict[str, int] = field(default_factory=dict)  # per pool, incl. the dummy page
    kv_pages_used: dict[str, int] = field(default_factory=dict)
    kv_pool_bytes: dict[str, int] = field(default_factory=dict)
    graph_capture_s: float = 0.0
    graph_batch_sizes: list[int] = field(default_factory=list)
    steps: int = 0
    encoder_calls: int = 0
    kv_dtype: str = ""  # e.g. "bfloat16", "float8_e4m3fn"
    kv_scales: dict = field(default_factory=dict)  # fp8 only: KVScales.summary() (method, min/max over layers)
    decode_gemv: dict = field(default_factory=dict)  # Gemma4ForCausalLM.set_decode_gemv's summary (auto: timings)
    w4a16_words: dict = field(default_factory=dict)  # Gemma4ForCausalLM.set_w4a16_words' summary (per NVFP4 shape)


class Engine:
    def __init__(
        self, model, cfg, engine_config: EngineConfig | None = None, vision_tower=None, ranges=None, memory=None,
        agree_kv_pages=None,
    ):  # fmt: skip
        """`ranges` (NVTX + timings, `.range(name)`) and `memory` (`.phase(name)`) are the capture instruments;
        the runner passes perfkit.capture's RangeRecorder and MemoryTracker, tests may omit them.
        `agree_kv_pages` ({pool: pages} -> {pool: pages}): tensor parallelism passes the minimum over ranks here,
        so every rank builds the same pools and schedules identically (the engine itself stays single-process)."""
        ec = engine_config or EngineConfig()
        self._recorder = ranges if ranges is not None else NULL_CAPTURE  # toggle nvtx=off swaps in NULL_CAPTURE
        self.ranges = self._recorder
        self.memory = memory if memory is not None else NULL_CAPTURE
        self.model, self.cfg, self.ec = model, cfg, ec
        self.device = model.device
        self.layers = cfg.attn_layers()
        if ec.kv_dtype != "auto" and ec.kv_dtype not in _DTYPES:
            raise PerfkitError(f"kv_dtype={ec.kv_dtype!r}; allowed: auto, {', '.join(_DTYPES)}")
        self.kv_dtype = model.dtype if ec.kv_dtype == "auto" else _DTYPES[ec.kv_dtype]
        self.kv_scales = self._fp8_kv_scales() if self.kv_dtype == torch.float8_e4m3fn else None
        self.vision_tower = vision_tower if vision_tower is not None else getattr(model, "vision_tower", None)
        self._next_id = 0
        self._requests: dict[int, Request] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._graph_capture_s = 0.0
        self._steps = 0
        self._agree_kv_pages = agree_kv_pages
        self._tokens = TokenTransfer(ec.max_batch_size, self.device)
        self._pending: _Launched | None = None  # overlap: the previous step, its ids not yet on the host
        self._warm_states: set[tuple] = set()  # toggle states whose prefill kernels ran (warm_up)
        self._validate_toggles(ec)
        self._check_pdl(ec.pdl)
        model.set_fused(ec.fused_kernels)
        self._words = model.set_w4a16_words(ec.w4a16_words)  # after set_fused: the merged shapes decide
        model.set_pdl(ec.pdl)
        model.set_decode_fusion(ec.decode_fusion, routed=ec.decode_routing, moe_ffn=ec.decode_moe_ffn)
        self._gemv = model.set_decode_gemv(ec.decode_gemv)  # after set_fused (the merged shapes) and set_pdl
        model.set_moe_gather(ec.moe_gather)
        model.set_moe_prefill(ec.moe_prefill)
        if model.rope is None or model.rope.max_positions < ec.max_model_len:
            model.setup_rope(ec.max_model_len)
        self._build(self._kv_pages())

    # ---- construction ----------------------------------------------------------------------------------------
    @staticmethod
    def _validate_toggles(ec: EngineConfig) -> None:
        for name in ("attention", "page_table", "mask", "moe_gather", "moe_prefill", "decode_attention", "decode_gemv",
                     "decode_moe_ffn", "w4a16_words"):  # fmt: skip
            if getattr(ec, name) not in TOGGLES[name]:
                raise PerfkitError(f"{name}={getattr(ec, name)!r}; allowed: {', '.join(TOGGLES[name])}")

    def _check_pdl(self, on: bool) -> None:
        if on:
            from perfkit.kernels.pdl import pdl_available

            if not pdl_available(self.device):
                raise PerfkitError(
                    f"pdl=on needs a CUDA GPU of compute capability 9.0 or newer (device {self.device}); use pdl=off"
                )

    def _fp8_kv_scales(self) -> KVScales:
        """Fixed per-cache-layer scales from the k_norm weights (the RMSNorm bound; no calibration data exists
        for random weights, and a bound never saturates). Read once here, host sync included."""
        amax = {}
        for la in self.layers:
            if la.writes_kv:
                w = self.model.layers[la.index].self_attn.k_norm.weight
                amax[la.index] = 1.0 if w is None else float(w.detach().abs().max())
        return rmsnorm_bound_kv_scales(self.layers, amax)

    def _kv_pages(self) -> dict[str, int]:
        ec = self.ec
        specs = pool_specs(self.layers)
        if ec.num_kv_pages is not None:
            return dict.fromkeys(specs, ec.num_kv_pages)
        if ec.kv_cache_bytes is not None:
            free, frac = ec.kv_cache_bytes, 1.0
        elif self.device.type == "cuda":
            free, frac = self._measure_free_bytes(), ec.kv_cache_fraction
        else:
            free, frac = _CPU_KV_BUDGET_BYTES, ec.kv_cache_fraction
        plan = plan_kv_pages(free, frac, self.cfg, ec.page_size, self.kv_dtype, ec.max_batch_size, ec.max_num_tokens)
        pages = dict(plan.num_pages)
        return pages if self._agree_kv_pages is None else self._agree_kv_pages(pages)

    def _measure_free_bytes(self) -> int:
        """Warm up with a max_num_tokens prefill on a minimal cache, then read the driver's free memory (the
        warmup's activations stay reserved in torch's allocator, so they are not counted as free). A second
        prefill follows, of one token fewer (or down to a multiple of 16): Triton specialises an integer argument
        on whether it is a multiple of 16, so a step's token count (and T * top_k) in either class compiles its
        kernels here, not in the first measured step that mixes decodes into a prefill chunk (H200 12-01h: 4
        compiles, 2.7 s, inside a 26B-A4B NVFP4 c64 window without it). Then the same pair at an eighth of the
        size: quantised MoE experts take another path below ``QuantizedExperts.dequant_min_pairs`` (12-01i: with
        the dequant path the default, 4 compiles of the sorted GEMMs' prefill tiles inside a c64 window). Then the
        small sizes whose quantised linears take their own kernel forms (``WARMUP_ROW_TOKENS``)."""
        n = min(self.ec.max_num_tokens, self.ec.max_model_len - 1)
        pages = {pool: self._pages_needed(spec.window, n + 1) + 1 for pool, spec in pool_specs(self.layers).items()}
        self._build(pages, graphs=False)
        self._warm_prefills(n)
        torch.cuda.synchronize()
        self._teardown()
        return torch.cuda.mem_get_info()[0]

    def warm_up(self) -> list[int]:
        """Run the KV-sizing warmup's prefills (``_warmup_prefill_tokens``) on the live engine, once per toggle
        state: a toggle switched after construction (``w4a16_words``, ``fused_kernels``, ``mask``, ...) makes prefills
        launch kernel forms the construction-time warmup (the first arm's toggles) never compiled, and a scenario's
        few warmup requests do not reach every row-count form (``WARMUP_ROW_TOKENS``). Returns the prefill sizes run
        (none when this state is warm). Needs an idle engine: its requests come and go here, nothing else is
        scheduled."""
        if self._toggle_state() in self._warm_states:
            return []
        if self.has_unfinished():
            raise PerfkitError("Engine.warm_up needs an idle engine: finish or abort the running requests first")
        return self._warm_prefills(min(self.ec.max_num_tokens, self.ec.max_model_len - 1))

    def _warm_prefills(self, n: int) -> list[int]:
        """Prefill each of ``_warmup_prefill_tokens(n)`` as its own request of BOS tokens and one output token, one
        at a time (the sizing warmup's cache holds one); records the toggle state as warm."""
        sizes = _warmup_prefill_tokens(n)
        for tokens in sizes:
            self.add_request([self.cfg.bos_token_id] * tokens, max_new_tokens=1)
            while self.has_unfinished():
                self.step()
        self._warm_states.add(self._toggle_state())
        return sizes

    def _toggle_state(self) -> tuple:
        return tuple(sorted(self.toggles().items()))

    def _build(self, num_pages: dict[str, int], graphs: bool = True) -> None:
        ec = self.ec
        specs = pool_specs(self.layers)
        self.kv = PagedKVCache(self.layers, num_pages, ec.page_size, self.kv_dtype, self.device, self.kv_scales)
        self.bm = BlockManager(num_pages, ec.page_size, {p: s.window for p, s in specs.items()})
        self.scheduler = Scheduler(self.bm, ec.max_batch_size, ec.max_num_tokens)
        self._backends: dict = {}
        self.runner = ModelRunner(
            self.model, self.cfg, self.bm, self._page_table_builder(ec.page_table), self._backend(ec.attention),
            max_num_tokens=ec.max_num_tokens, vision_tower=self.vision_tower, ranges=self.ranges, memory=self.memory,
        )  # fmt: skip
        self.runner.mask_impl = ec.mask
        self.runner.mm_embed_cache = ec.mm_embed_cache
        self.runner.max_images_per_encode = ec.max_images_per_encode
        self._graphs = None
        if graphs:
            self._sync_graphs()

    def _teardown(self) -> None:
        self._graphs = None
        self.runner = self.scheduler = self.bm = self.kv = None
        self._backends = {}
        self._requests.clear()

    def _page_table_builder(self, kind: str):
        return make_page_table_builder(kind, self.bm, self.device, self.ec.max_num_tokens, self.ec.max_batch_size)

    def _backend(self, name: str):
        if name not in self._backends:
            if name == "torch":
                from perfkit.runtime.attention.torch_paged import TorchPagedBackend

                self._backends[name] = TorchPagedBackend(self.kv)
            else:
                from perfkit.runtime.attention.flashinfer import FlashInferBackend

                self._backends[name] = FlashInferBackend(
                    self.kv, workspace_bytes=self.ec.workspace_bytes,
                    decode_use_tensor_cores=self.ec.decode_use_tensor_cores, q_dtype=self.model.dtype,
                    decode_kernel=self.ec.decode_attention, max_batch_size=self.ec.max_batch_size, pdl=self.ec.pdl,
                    decode_prologue=self.ec.decode_prologue, decode_merge=self.ec.decode_merge,
                )  # fmt: skip
        return self._backends[name]

    def _sync_graphs(self) -> None:
        """Capture decode graphs when cuda_graphs=on and the current backend supports them; else run eagerly."""
        backend = self.runner.backend
        want = self.ec.cuda_graphs and getattr(backend, "supports_cuda_graphs", False) and self.device.type == "cuda"
        if not want:
            self.runner.graphs = None
            return
        if self._graphs is None or self._graphs.backend is not backend:
            from perfkit.runtime.cuda_graphs import DecodeGraphs

            t0 = time.perf_counter()
            with self.ranges.range("graph_capture"):
                # decode_io's one upload per step writes the host builder's tables; page_table=padded keeps its own
                pages = ({p: self._pages_needed(spec.window, self.ec.max_model_len) for p, spec in self.kv.specs.items()}
                         if self.ec.page_table == "host" else None)  # fmt: skip
                self._graphs = DecodeGraphs(self.model, backend, self.kv, self.bm, self.ec.max_batch_size,
                                            fused_io=self.ec.decode_io, max_pages_per_row=pages)  # fmt: skip
                self._graphs.capture()
            self._graph_capture_s += time.perf_counter() - t0
        self.runner.graphs = self._graphs

    # ---- toggles ---------------------------------------------------------------------------------------------
    def set_toggle(self, name: str, value) -> None:
        """Switch a toggle on the live engine (KV cache and running requests are kept)."""
        if isinstance(value, bool):
            value = "on" if value else "off"
        if name not in TOGGLES or value not in TOGGLES[name]:
            allowed = ", ".join(f"{k}={'|'.join(v)}" for k, v in TOGGLES.items())
            raise PerfkitError(f"unknown toggle {name}={value!r}; allowed: {allowed}")
        on = value == "on"
        if name == "attention":
            self.ec = replace(self.ec, attention=value)
            self.runner.backend = self._backend(value)
            self._sync_graphs()
        elif name == "page_table":
            self.ec = replace(self.ec, page_table=value)
            self.runner.page_tables = self._page_table_builder(value)
            if self._graphs is not None and self.ec.decode_io:  # its graphs read the host builder's one upload
                self._graphs = None
                self._sync_graphs()
        elif name == "mask":
            self.ec = replace(self.ec, mask=value)
            self.runner.mask_impl = value
        elif name == "mm_embed_cache":
            self.ec = replace(self.ec, mm_embed_cache=on)
            self.runner.mm_embed_cache = on
        elif name == "cuda_graphs":
            self.ec = replace(self.ec, cuda_graphs=on)
            self._sync_graphs()
        elif name == "nvtx":
            self.ranges = self._recorder if on else NULL_CAPTURE
            self.runner.ranges = self.ranges
        elif name == "overlap":  # a step already pending is resolved by the next step() either way
            self.ec = replace(self.ec, overlap=on)
        elif name == "fused_kernels" and on != self.ec.fused_kernels:
            self.ec = replace(self.ec, fused_kernels=on)
            self.model.set_fused(on)
            self._words = self.model.set_w4a16_words(self.ec.w4a16_words)
            self._gemv = self.model.set_decode_gemv(self.ec.decode_gemv)  # merging changed the shapes
            self._graphs = None  # captured graphs replay the other path: capture again
            self._sync_graphs()
        elif name == "moe_gather" and value != self.ec.moe_gather:
            self.ec = replace(self.ec, moe_gather=value)
            if self.model.set_moe_gather(value):  # only models with NVFP4 experts change path
                self._graphs = None
                self._sync_graphs()
        elif name == "decode_attention" and value != self.ec.decode_attention:
            self.ec = replace(self.ec, decode_attention=value)
            self._set_flashinfer("decode_kernel", value)
        elif name == "decode_prologue" and (value == "fused") != self.ec.decode_prologue:
            self.ec = replace(self.ec, decode_prologue=value == "fused")
            self._set_flashinfer("decode_prologue", self.ec.decode_prologue)
        elif name == "decode_merge" and value != self.ec.decode_merge:
            self.ec = replace(self.ec, decode_merge=value)
            self._set_flashinfer("decode_merge", value)
        elif name == "decode_io" and (value == "fused") != self.ec.decode_io:
            self.ec = replace(self.ec, decode_io=value == "fused")
            self._graphs = None  # the graphs' tail launches the other kernels: capture again
            self._sync_graphs()
        elif name == "w4a16_words" and value != self.ec.w4a16_words:
            self.ec = replace(self.ec, w4a16_words=value)
            self._words = self.model.set_w4a16_words(value)
            self._graphs = None  # the graphs' kernels read the words in one order: capture again
            self._sync_graphs()
        elif name == "decode_gemv" and value != self.ec.decode_gemv:
            self.ec = replace(self.ec, decode_gemv=value)
            self._gemv = self.model.set_decode_gemv(value)  # auto times each shape once per model
            self._graphs = None  # the batch-1 graph launches the other GEMMs: capture again
            self._sync_graphs()
        elif name == "pdl" and on != self.ec.pdl:
            self._check_pdl(on)
            self.ec = replace(self.ec, pdl=on)
            self.model.set_pdl(on)
            fi = self._backends.get("flashinfer")  # the torch backend launches no Triton kernel
            if fi is not None:
                fi.pdl = on
            self._gemv = self.model.set_decode_gemv(self.ec.decode_gemv)  # decode_gemv=auto timed with / without
            self._graphs = None  # the captured graphs launch without / with it: capture again
            self._sync_graphs()
        elif (
            (name == "decode_fusion" and on != self.ec.decode_fusion)
            or (name == "decode_routing" and (value == "fused") != self.ec.decode_routing)
            or (name == "decode_moe_ffn" and value != self.ec.decode_moe_ffn)
        ):
            if name == "decode_fusion":
                self.ec = replace(self.ec, decode_fusion=on)
            elif name == "decode_routing":
                self.ec = replace(self.ec, decode_routing=value == "fused")
            else:
                self.ec = replace(self.ec, decode_moe_ffn=value)
            ec = self.ec
            self.model.set_decode_fusion(ec.decode_fusion, routed=ec.decode_routing, moe_ffn=ec.decode_moe_ffn)
            self._graphs = None  # the captured graphs launch the other kernels: capture again
            self._sync_graphs()
        elif name == "moe_prefill" and value != self.ec.moe_prefill:  # prefill runs eagerly: no graph to redo
            self.ec = replace(self.ec, moe_prefill=value)
            self.model.set_moe_prefill(value)

    def _set_flashinfer(self, attr: str, value) -> None:
        """A FlashInfer-backend setting switched live (the torch backend has none): set it on the backend if it was
        built, and capture its graphs again when they are current (they launch the other kernels)."""
        fi = self._backends.get("flashinfer")
        if fi is not None:
            setattr(fi, attr, value)
            if self._graphs is not None and self._graphs.backend is fi:
                self._graphs = None
                self._sync_graphs()

    def toggles(self) -> dict[str, str]:
        ec = self.ec
        return {
            "attention": ec.attention, "page_table": ec.page_table, "mask": ec.mask,
            "mm_embed_cache": "on" if ec.mm_embed_cache else "off", "cuda_graphs": "on" if ec.cuda_graphs else "off",
            "fused_kernels": "on" if ec.fused_kernels else "off",
            "nvtx": "on" if self.ranges is self._recorder else "off", "overlap": "on" if ec.overlap else "off",
            "moe_gather": ec.moe_gather, "moe_prefill": ec.moe_prefill, "decode_attention": ec.decode_attention,
            "decode_gemv": ec.decode_gemv, "pdl": "on" if ec.pdl else "off",
            "decode_fusion": "on" if ec.decode_fusion else "off",
            "decode_routing": "fused" if ec.decode_routing else "separate",
            "decode_moe_ffn": ec.decode_moe_ffn,
            "decode_prologue": "fused" if ec.decode_prologue else "separate",
            "decode_merge": ec.decode_merge,
            "decode_io": "fused" if ec.decode_io else "separate",
            "w4a16_words": ec.w4a16_words,
        }  # fmt: skip

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids,
        mm_items=None,
        max_new_tokens: int = 16,
        ignore_eos: bool = True,
        token_type_ids=None,
        sampling: SamplingParams | None = None,
    ) -> int:
        ids = [int(t) for t in prompt_token_ids]
        if not ids or max_new_tokens < 1:
            raise PerfkitError("a request needs at least one prompt token and max_new_tokens >= 1")
        total = len(ids) + max_new_tokens
        if total > self.ec.max_model_len:
            raise PerfkitError(f"prompt + max_new_tokens = {total} exceeds max_model_len {self.ec.max_model_len}")
        for pool, spec in self.kv.specs.items():  # a request must fit alone, or preemption could never end
            need = self._pages_needed(spec.window, total)
            if need > self.kv.num_pages[pool] - 1:
                raise PerfkitError(f"request needs {need} {pool} KV pages, the pool has {self.kv.num_pages[pool] - 1}")
        if token_type_ids is None:
            c = self.cfg
            kinds = {c.image_token_id: 1, c.video_token_id: 2, c.audio_token_id: 3}
            token_type_ids = [kinds.get(t, 0) for t in ids]
        rid = self._next_id
        self._next_id += 1
        req = Request(
            rid, ids, [int(t) for t in token_type_ids], max_new_tokens, ignore_eos, tuple(self.cfg.eos_token_id),
            list(mm_items) if mm_items else None, sampling or SamplingParams(),
        )  # fmt: skip
        self._requests[rid] = req
        if req.sampling.temperature > 0:
            g = torch.Generator(device=self.device)
            g.manual_seed(self.ec.seed + rid if req.sampling.seed is None else req.sampling.seed)
            self._generators[rid] = g
        self.scheduler.add(req)
        return rid

    def _pages_needed(self, window: int | None, total_tokens: int) -> int:
        """Pages one request of `total_tokens` holds at most in a pool: all of them on full layers; on sliding
        layers the window plus one step's chunk (older pages are freed), never more than the whole request."""
        ps = self.ec.page_size
        full = math.ceil(total_tokens / ps)
        if window is None:
            return full
        return min(full, math.ceil((window - 1 + self.ec.max_num_tokens) / ps) + 1)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def request(self, request_id: int) -> Request:
        return self._requests[request_id]

    # ---- the loop --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One engine iteration, each phase an NVTX range: schedule -> prepare -> forward -> sample (launched, not
        waited for) -> resolve the previous step's ids -> postprocess. Returns the tokens that reached the host."""
        R = self.ranges.range
        with R("step"):
            with R("schedule"):
                sched = self.scheduler.schedule()
            launched = None
            if not sched.empty:
                self._steps += 1
                prev_ids = None if self._pending is None else self._pending.ids
                with R("prepare_inputs"):
                    inputs = self.runner.prepare(sched, prev_ids)
                with R("forward_decode" if sched.num_decodes == len(sched.chunks) else "forward_prefill"):
                    logits = self.runner.forward(inputs)
                with R("sample"):
                    reqs = inputs.sample_reqs
                    gens = [self._generators.get(r.request_id) for r in reqs]
                    greedy = self.runner.greedy_ids(inputs)
                    ids = sample_on_device(logits, [r.sampling for r in reqs], gens, greedy=greedy)
                    launched = _Launched(ids, self._tokens.start(ids), self._defer(reqs))
            outputs = self._resolve(self._pending) if self._pending is not None else []
            self._pending = None
            if launched is not None:
                with R("postprocess"):
                    launched.slots = self.scheduler.advance(sched)
                if launched.deferrable:
                    self._pending = launched  # the next step resolves it, after queueing its own work
                else:
                    outputs += self._resolve(launched)
        return outputs

    def _defer(self, sampled: list[Request]) -> bool:
        """May the next step be scheduled before this step's ids are known? Only when no sampled request can stop
        on EOS (the benchmark case: ignore_eos), so the next batch is the same whatever the ids are."""
        return self.ec.overlap and all(r.ignore_eos for r in sampled)

    def _resolve(self, launched: _Launched) -> list[StepOutput]:
        """Wait for a launched step's ids on the host and commit them (timestamps taken here)."""
        with self.ranges.range("resolve"):
            token_ids = self._tokens.wait(launched.ticket)
            t_host_ns = time.perf_counter_ns()
            outputs = self.scheduler.commit(launched.slots, token_ids, t_host_ns)
            for o in outputs:
                if o.finished:  # a long run must not keep every finished request's token lists
                    self.runner.release(o.request_id)
                    self._generators.pop(o.request_id, None)
                    self._requests.pop(o.request_id, None)
        return outputs

    def abort_all(self) -> None:
        """Drop every waiting and running request and free its pages (after a failed scenario)."""
        if self._pending is not None:
            self._tokens.wait(self._pending.ticket)  # its copy must land before the buffer is reused
            self._pending = None
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.bm.free(req.request_id)
            self.runner.release(req.request_id)
            self._generators.pop(req.request_id, None)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()

    def set_vision_tower(self, tower) -> None:
        self.vision_tower = tower
        self.runner.vision_tower = tower

    def generate_all(self) -> dict[int, list[int]]:
        """Run until every request finished; returns the new tokens per request id (tests, simple runners)."""
        out: dict[int, list[int]] = {}
        while self.has_unfinished():
            for o in self.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            preemptions=self.scheduler.num_preemptions,
            kv_pages=dict(self.kv.num_pages),
            kv_pages_used={p: self.bm.num_used(p) for p in self.bm.pools},
            kv_pool_bytes=self.kv.pool_bytes(),
            graph_capture_s=self._graph_capture_s,
            graph_batch_sizes=list(self._graphs.sizes) if self._graphs is not None else [],
            steps=self._steps,
            encoder_calls=self.runner.num_encoder_calls,
            kv_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_scales=self.kv_scales.summary() if self.kv_scales is not None else {},
            decode_gemv=self._gemv,
            w4a16_words=self._words,
        )


# A warmup prefill size between 33 and 128 tokens: at top-8 routing, 257-1024 pairs, where the sorted MoE GEMMs
# take their decode tiles (moe._tiles) and neither n nor n // 8 lands for any n >= 264. Without it a mixed step of
# that size compiled them inside a measured window (12-06 call 1: 26B-A4B c16, _moe_gemm_kernel x2).
WARMUP_SMALL_PREFILL_TOKENS = 64
# Row counts whose quantised linears take a kernel form no other warmup size or decode graph reaches: the W4A16 dot
# path's 128-row tile (M 65-143) in both multiple-of-16 classes, the tensor-core gemv's two 16-row groups (M 17-32)
# in both, and its 16-row form off the class of the captured batch 16 (M 9-15). Without them a mixed step of such
# a size compiled inside a measured window (H200 12-18 call 7: 31B NVFP4 c32, `_w4a16_dot_kernel` x3, 1.45 s).
WARMUP_ROW_TOKENS = (143, 128, 32, 31, 15)


def _warmup_prefill_tokens(n: int) -> list[int]:
    """The KV-sizing warmup's prefill sizes for a largest prefill of n tokens: n, n // 8 and
    WARMUP_SMALL_PREFILL_TOKENS (when below n), each with its other multiple-of-16 class (one fewer, or down to a
    multiple of 16), as large as it can be, then the WARMUP_ROW_TOKENS below n; no size below 1, no repeats."""
    sizes: list[int] = []
    for m in (n, n // 8, WARMUP_SMALL_PREFILL_TOKENS if WARMUP_SMALL_PREFILL_TOKENS < n else 0):
        other = m - 1 if m % 16 == 0 else m - m % 16
        sizes += [t for t in (m, other) if t > 0 and t not in sizes]
    return sizes + [t for t in WARMUP_ROW_TOKENS if t < n and t not in sizes]
