"""FlashInfer attention A/B at a model's exact pool shapes: which decode kernel and which prefill backend to use.

Issue #9 asks to pick tensor-core vs CUDA-core decode and FA2 vs FA3 prefill by measurement, not by rule of
thumb (flashinfer.md §2.5: tensor cores when the GQA group is >= 4). Gemma4 has two pools per model (sliding:
head_dim 256 with a window, full: head_dim 512), and they differ in GQA group, so each pool is timed on its own.

Cases (``attention_cases``, pure: testable on a CPU):

- decode, per (pool, batch, kv_len, impl): ``cuda_cores`` (FlashInfer's batch-decode kernel), ``tc_fa2`` /
  ``tc_fa3`` (``use_tensor_cores=True``: decode through the paged-prefill kernels of that backend), ``triton``
  (perfkit's split-KV kernel, ``perfkit.kernels.paged_decode``, with the engine's split rule, or one row per
  ``triton_tiles`` entry: block_n, num_warps, programs_per_sm, for tuning its defaults). A sliding pool
  only ever holds ``min(kv_len, window)`` keys per request (the engine frees pages that left the window), so
  that is what the case reads. Bound = bytes (KV read + q + out) / HBM bandwidth.
- prefill, per (pool, q_len, impl in fa2 / fa3): one causal request of ``q_len`` new tokens (sliding: the window
  applies). Bound = attention FLOPs (QK^T and PV, 4 * heads * head_dim per visible (query, key) pair) / the
  measured matmul rate.

Every impl of a case sees the same q and KV (seeded); ``max_abs_diff`` is its output's distance from the first
impl's. Timing (``run_attention_sweep``, CUDA + flashinfer): decode replays a CUDA graph of ``copies`` run() calls over
distinct KV tensors (the engine replays decode graphs, and one layer's KV must not sit in L2 for the next: the
copies together exceed 2x the L2), median over ``repeats`` replays / copies. Prefill: CUDA events around
eager run() calls, median over ``repeats``. A case the backend cannot run (FA3 at head_dim 512) is recorded as
``error`` with FlashInfer's message, and the sweep goes on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from perfkit.capture.ranges import percentile
from perfkit.errors import PerfkitError
from perfkit.kernels.launch import sm_count
from perfkit.kernels.paged_decode import DECODE_BLOCK_N, paged_decode_attention, pick_splits
from perfkit.runtime.attention.flashinfer import window_left
from perfkit.runtime.kv_cache import PoolSpec, pool_specs
from perfkit.runtime.model_config import get_preset

DECODE_IMPLS = ("cuda_cores", "tc_fa2", "tc_fa3", "triton")
PREFILL_IMPLS = ("fa2", "fa3")
HBM_BYTES_PER_S = 4.3e12  # H200 achievable DRAM bandwidth
MATMUL_FLOPS_PER_S = 790e12  # H200 bf16 dense matmul rate measured with cuBLAS (device README)
L2_BYTES = 50 << 20  # H200 L2 (50 MiB): decode copies together exceed twice this
KV_BYTES = {"bf16": 2, "fp8": 1}
TRITON_TILE_KEYS = ("block_n", "num_warps", "programs_per_sm")


def _check_impls(kind: str, impls: Sequence[str], allowed: Sequence[str]) -> None:
    bad = [i for i in impls if i not in allowed]
    if bad:
        raise PerfkitError(f"{kind} impl(s) {', '.join(bad)}: allowed values are {', '.join(allowed)}")


def model_pools(preset: str) -> dict[str, PoolSpec]:
    try:
        cfg = get_preset(preset)
    except (KeyError, ValueError) as err:
        raise PerfkitError(f"--preset {preset!r}: {err}") from None
    return pool_specs(cfg.attn_layers())


def decode_kv_len(spec: PoolSpec, kv_len: int) -> int:
    """Keys one decode query reads: the window caps a sliding pool (its older pages are freed)."""
    return min(kv_len, spec.window) if spec.window is not None else kv_len


def decode_bytes(spec: PoolSpec, batch: int, kv_len: int, kv_bytes: int, q_bytes: int = 2) -> int:
    """KV read (K and V) + q read + out written for one decode step of one layer."""
    kv = batch * decode_kv_len(spec, kv_len) * spec.num_kv_heads * spec.head_dim * 2 * kv_bytes
    return kv + 2 * batch * spec.num_heads * spec.head_dim * q_bytes


def prefill_flops(spec: PoolSpec, q_len: int) -> int:
    """Causal (and windowed) attention FLOPs of one q_len-token request: 4 * heads * head_dim per visible pair."""
    w = spec.window or q_len
    w = min(w, q_len)
    # query i sees min(i + 1, w) keys: the first w queries a triangle, the rest w each
    pairs = w * (w + 1) // 2 + (q_len - w) * w
    return 4 * spec.num_heads * spec.head_dim * pairs


def attention_cases(
    preset: str,
    pools: Sequence[str],
    batch_sizes: Sequence[int],
    kv_lens: Sequence[int],
    prefill_q_lens: Sequence[int],
    decode_impls: Sequence[str],
    prefill_impls: Sequence[str],
    kv_dtype: str = "bf16",
    hbm_bytes_s: float = HBM_BYTES_PER_S,
    matmul_flops_s: float = MATMUL_FLOPS_PER_S,
    triton_tiles: Sequence[dict[str, int]] = (),
) -> list[dict[str, Any]]:
    """One row per case with its shape and bound filled and the measurement fields empty; the triton impl once per
    ``triton_tiles`` entry (its ``tile``), or once with the kernel's defaults when there are none."""
    _check_impls("decode", decode_impls, DECODE_IMPLS)
    bad = [t for t in triton_tiles if set(t) - set(TRITON_TILE_KEYS)]
    if bad:
        raise PerfkitError(f"triton tile {bad[0]}: keys are {', '.join(TRITON_TILE_KEYS)}")
    _check_impls("prefill", prefill_impls, PREFILL_IMPLS)
    if kv_dtype not in KV_BYTES:
        raise PerfkitError(f"--kv-dtype {kv_dtype!r}: allowed values are {', '.join(KV_BYTES)}")
    specs = model_pools(preset)
    missing = [p for p in pools if p not in specs]
    if missing:
        raise PerfkitError(f"--pools {','.join(missing)}: {preset} has pools {', '.join(specs)}")
    rows: list[dict[str, Any]] = []

    def row(spec: PoolSpec, phase: str, impl: str, shape: dict[str, Any], bound_ms: float) -> dict[str, Any]:
        return {
            "kernel": f"attention_{phase}",
            "impl": impl,
            "shape": {
                "preset": preset,
                "pool": spec.name,
                "heads": spec.num_heads,
                "kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "window": spec.window,
                "kv_dtype": kv_dtype,
                **shape,
            },
            "status": "ok",
            "message": None,
            "median_ms": None,
            "p10_ms": None,
            "p90_ms": None,
            "bound_ms": bound_ms,
            "x_bound": None,
            "timing": None,
        }

    for p in pools:
        spec = specs[p]
        lens = sorted({decode_kv_len(spec, n) for n in kv_lens})  # a window makes longer contexts the same case
        for b in batch_sizes:
            for n in lens:
                nbytes = decode_bytes(spec, b, n, KV_BYTES[kv_dtype])
                for impl in decode_impls:
                    for tile in (triton_tiles or [None]) if impl == "triton" else [None]:
                        r = row(spec, "decode", impl, {"batch": b, "kv_len": decode_kv_len(spec, n)},
                                nbytes / hbm_bytes_s * 1e3)  # fmt: skip
                        r["bytes"] = nbytes
                        if tile is not None:
                            r["tile"] = dict(tile)
                        rows.append(r)
        for q in prefill_q_lens:
            flops = prefill_flops(spec, q)
            for impl in prefill_impls:
                r = row(spec, "prefill", impl, {"q_len": q}, flops / matmul_flops_s * 1e3)
                r["flops"] = flops
                rows.append(r)
    return rows


# --------------------------------------------------------------------------------------------------------------
# GPU measurement
# --------------------------------------------------------------------------------------------------------------


def _pages_for(tokens: int, page_size: int) -> tuple[int, int]:
    """(pages, last_page_len) of a sequence of ``tokens`` keys."""
    pages = max(1, math.ceil(tokens / page_size))
    return pages, tokens - (pages - 1) * page_size


def _decode_fn(fi, torch, row: dict[str, Any], spec: PoolSpec, page_size: int, workspace) -> tuple[Callable, int, Any]:
    """A CUDA graph of one decode run() per KV copy; returns (replay, copies, output of the last copy)."""
    s, dev = row["shape"], torch.device("cuda")
    b, n = s["batch"], s["kv_len"]
    kv_dt = torch.float8_e4m3fn if s["kv_dtype"] == "fp8" else torch.bfloat16
    pages, last = _pages_for(n, page_size)
    copies = max(1, math.ceil(2 * L2_BYTES / max(row["bytes"], 1)))
    caches = [
        torch.randn(b * pages, 2, page_size, spec.num_kv_heads, spec.head_dim, device=dev).to(kv_dt)
        for _ in range(copies)
    ]
    indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32)
    indices = torch.arange(b * pages, dtype=torch.int32, device=dev)
    last_len = torch.full((b,), last, dtype=torch.int32)
    impl = row["impl"]
    q = torch.randn(b, spec.num_heads, spec.head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    if impl == "triton":
        indptr_d, lens_d = indptr.to(dev), torch.full((b,), n, dtype=torch.int32, device=dev)
        tile = row.get("tile", {})
        splits = pick_splits(b, spec.num_kv_heads, sm_count(dev), spec.window, tile.get("block_n", DECODE_BLOCK_N),
                             tile.get("programs_per_sm"))  # fmt: skip
        row["num_splits"] = splits
        launch = {k: v for k, v in tile.items() if k != "programs_per_sm"}  # block_n, num_warps

        def run(c):
            paged_decode_attention(q, c, indices, indptr_d, lens_d, window=spec.window, num_splits=splits, out=out,
                                   **launch)  # fmt: skip
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=impl != "cuda_cores", backend="fa3" if impl == "tc_fa3" else "auto"
        )
        wrapper.plan(indptr, indices, last_len, spec.num_heads, spec.num_kv_heads, spec.head_dim, page_size,
                     window_left=window_left(spec.window), sm_scale=1.0, q_data_type=torch.bfloat16,
                     kv_data_type=kv_dt)  # fmt: skip

        def run(c):
            wrapper.run(q, c, out=out)

    for c in caches:  # warm up (and fail here, outside the capture, when the backend cannot run the case)
        run(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for c in caches:
            run(c)
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay, copies, out


def _prefill_fn(fi, torch, row: dict[str, Any], spec: PoolSpec, page_size: int, workspace) -> tuple[Callable, int, Any]:
    s, dev = row["shape"], torch.device("cuda")
    n = s["q_len"]
    kv_dt = torch.float8_e4m3fn if s["kv_dtype"] == "fp8" else torch.bfloat16
    pages, last = _pages_for(n, page_size)
    cache = torch.randn(pages, 2, page_size, spec.num_kv_heads, spec.head_dim, device=dev).to(kv_dt)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=row["impl"])
    wl = window_left(spec.window)
    wrapper.plan(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
                 torch.arange(pages, dtype=torch.int32, device=dev), torch.tensor([last], dtype=torch.int32),
                 spec.num_heads, spec.num_kv_heads, spec.head_dim, page_size, causal=True, window_left=wl,
                 sm_scale=1.0, q_data_type=torch.bfloat16, kv_data_type=kv_dt)  # fmt: skip
    q = torch.randn(n, spec.num_heads, spec.head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    return (lambda: wrapper.run(q, cache, out=out)), 1, out


def _time(torch, fn: Callable, per_call: int, repeats: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_call)
    return {"median_ms": statistics.median(times), "p10_ms": percentile(times, 10), "p90_ms": percentile(times, 90)}


def run_attention_sweep(
    rows: list[dict[str, Any]],
    page_size: int = 16,
    repeats: int = 20,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure every case of ``attention_cases`` in place (needs CUDA and flashinfer)."""
    import torch

    if not torch.cuda.is_available():
        raise PerfkitError("perfkit kernels attention needs a CUDA GPU with flashinfer installed")
    try:
        import flashinfer as fi
    except ImportError:
        raise PerfkitError("perfkit kernels attention needs flashinfer-python (pip install 'perfkit[gpu]')") from None
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    specs: dict[str, dict[str, PoolSpec]] = {}
    first_out: dict[str, tuple[str, Any]] = {}  # case -> (impl, output): every impl must compute the same thing
    for row in rows:
        s = row["shape"]
        spec = specs.setdefault(s["preset"], model_pools(s["preset"]))[s["pool"]]
        build = _decode_fn if row["kernel"] == "attention_decode" else _prefill_fn
        case = f"{row['kernel']} {sorted(s.items())}"
        try:
            torch.manual_seed(0)  # the same q and KV for every impl of a case
            fn, per_call, out = build(fi, torch, row, spec, page_size, workspace)
            row.update(_time(torch, fn, per_call, repeats))
            ref_impl, ref = first_out.setdefault(case, (row["impl"], out.float()))
            row["max_abs_diff"] = float((out.float() - ref).abs().max())
            row["diff_vs"] = ref_impl
            row["x_bound"] = row["median_ms"] / row["bound_ms"]
            row["timing"] = f"cuda graph of {per_call} calls" if build is _decode_fn else "eager"
            if "flops" in row:
                row["tflops"] = row["flops"] / row["median_ms"] / 1e9
            else:
                row["achieved_tb_s"] = row["bytes"] / row["median_ms"] / 1e9
        except Exception as err:  # recorded; the sweep goes on (e.g. FA3 at head_dim 512)
            row.update(status="error", message=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        fn = out = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if on_row is not None:
            on_row(row)
    return rows


def impl_label(row: dict[str, Any]) -> str:
    """The impl, with the Triton tile when the row has one: 'triton 64x4x2' (block_n x num_warps x programs_per_sm)."""
    tile = row.get("tile")
    if not tile:
        return row["impl"]
    return f"{row['impl']} " + "x".join(str(tile.get(k, "-")) for k in TRITON_TILE_KEYS)


def parse_triton_tiles(text: str) -> list[dict[str, int]]:
    """``--triton-tiles 32x4x2,64x4x4`` -> [{block_n, num_warps, programs_per_sm}, ...]; PerfkitError otherwise."""
    tiles = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise PerfkitError(f"--triton-tiles {text!r}: expected BLOCK_NxWARPSxPROGRAMS_PER_SM items, e.g. 32x4x2,64x4x4")
        tiles.append(dict(zip(TRITON_TILE_KEYS, map(int, parts), strict=True)))
    return tiles


def best_impls(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Fastest ok impl per (phase, pool, batch / q_len, kv_len), as 'decode sliding b1 kv1024' -> 'tc_fa2'
    (``impl_label``: a Triton tile is part of the name)."""
    best: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["status"] != "ok" or r["median_ms"] is None:
            continue
        s = r["shape"]
        if r["kernel"] == "attention_decode":
            key = f"decode {s['pool']} b{s['batch']} kv{s['kv_len']}"
        else:
            key = f"prefill {s['pool']} q{s['q_len']}"
        if key not in best or r["median_ms"] < best[key][0]:
            best[key] = (r["median_ms"], impl_label(r))
    return {k: v[1] for k, v in best.items()}
