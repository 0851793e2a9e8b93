"""Kernel sweeps: A/B implementations of one kernel over shapes -> peak memory, latency, distance from the bound.

``run_mask_sweep`` measures the Gemma4 packed attention mask (``perfkit.kernels.gemma_mask``), dense (A) vs
Triton (B), one image-heavy context request per shape. Per (shape, impl):

- ``peak_allocated_bytes``: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus the
  bytes allocated just before the call, so it includes the output and every temporary (None on CPU);
- ``median_ms`` / ``p10_ms`` / ``p90_ms`` over ``repeats`` warmed calls, each timed from an idle GPU with CUDA
  events around the call (host launch overhead included, as a serving step would see it); ``perf_counter`` on CPU;
- ``device_median_ms`` (CUDA): the same call enqueued behind a ~0.5 ms GPU sleep, so the host's launch work
  happens while the GPU is busy and the events time the device work alone (as in an engine step whose host runs
  ahead of the GPU); ``x_bound_device`` = that / bound;
- ``bound_ms`` = output bytes / write bandwidth (default 4.3e12 B/s, H200) and ``x_bound`` = median / bound;
- ``status``: ok, oom (``torch.OutOfMemoryError`` under the ``budget_gib`` allocator cap; memory is freed and the
  sweep continues), error (message), or skipped (CPU only: predicted peak above the budget, since CPU has no
  allocator cap).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from perfkit.capture.ranges import percentile

H200_WRITE_BW_BYTES_S = 4.3e12
GiB = 2**30


def image_heavy_token_types(
    q_len: int, image_tokens: int = 280, text_between: int = 16, head_text: int = 64
) -> torch.Tensor:
    """Token types of one image-heavy prompt: a text header, then (boi, N image tokens, eoi, some text) repeated.

    boi/eoi are text tokens (type 0), so each image is its own blob (gemma4.md §4.3).
    """
    unit = np.concatenate([[0], np.ones(image_tokens, np.int64), [0], np.zeros(text_between, np.int64)])
    reps = max(0, q_len - head_text) // len(unit) + 1
    types = np.concatenate([np.zeros(head_text, np.int64), np.tile(unit, reps)])[:q_len]
    return torch.from_numpy(np.ascontiguousarray(types))


def _triton_unavailable(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    from perfkit.kernels import gemma_mask as gm

    if type(gm._gemma_mask_kernel).__name__ != "InterpretedFunction":
        return "triton on CPU needs TRITON_INTERPRET=1 set before triton is imported"
    return None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _cuda_times(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, busy: bool = False) -> list[float]:
    """CUDA-event ms of ``repeats`` calls, each started from an idle GPU (``busy``: queued behind a GPU sleep,
    so the host's launch work overlaps it); the output is freed between calls."""
    times: list[float] = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        if busy:
            torch.cuda._sleep(1_000_000)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        del out
    return times


def _measure(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    """Warm up, one call for peak memory and a checksum, then ``repeats`` timed calls (output freed in between)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        out = fn()
        del out
    _free(device)
    row: dict[str, Any] = {}
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        row["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
    else:
        out = fn()
        row["peak_allocated_bytes"] = None
    # count in slices: a bool .sum() over the whole mask would materialise an int64 copy (8x the output)
    row["true_count"] = sum(int(torch.count_nonzero(part)) for part in out.view(-1).split(1 << 24))
    del out
    if cuda:
        times_ms = _cuda_times(fn, device, repeats)
    else:
        times_ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            times_ms.append((time.perf_counter() - t0) * 1e3)
            del out
    row.update(median_ms=statistics.median(times_ms), p10_ms=percentile(times_ms, 10), p90_ms=percentile(times_ms, 90))
    # CUDA: the same call behind a ~0.5 ms GPU sleep: the host launches it meanwhile, the events time the device
    row["device_median_ms"] = statistics.median(_cuda_times(fn, device, repeats, busy=True)) if cuda else None
    return row


def run_mask_sweep(
    q_lens: Sequence[int],
    prefix_lens: Sequence[int] = (0,),
    window: int | None = 1024,
    impls: Sequence[str] = ("dense", "triton"),
    budget_gib: float | None = None,
    repeats: int = 20,
    device: str | torch.device | None = None,
    *,
    warmup: int = 2,
    write_bw_bytes_s: float = H200_WRITE_BW_BYTES_S,
    image_tokens: int = 280,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Sweep shapes (q_len x prefix_len, one image-heavy request each) x impls; one row per (shape, impl).

    ``budget_gib`` caps the CUDA caching allocator at budget / total memory for the whole sweep (restored
    afterwards); on CPU it only skips shapes whose predicted peak exceeds it.
    """
    from perfkit.kernels.gemma_mask import build_gemma_attention_mask, gemma_mask_peak_bytes, gemma_mask_traffic

    for impl in impls:
        if impl not in ("dense", "triton"):
            raise ValueError(f"impl {impl!r}: allowed values are dense, triton")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    budget_bytes = None if budget_gib is None else int(budget_gib * GiB)
    rows: list[dict[str, Any]] = []
    if cuda and budget_bytes is not None:
        # the budget is on top of what this process already holds (a model, earlier tests): cap the caching
        # allocator at held + budget, after returning cached blocks so they do not count
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        held = torch.cuda.memory_reserved(dev)  # the cap bounds reserved memory: blocks still cached count
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + budget_bytes) / total), dev)
    try:
        for q in q_lens:
            for p in prefix_lens:
                types_cpu = image_heavy_token_types(int(q), image_tokens=image_tokens)
                shape = {
                    "q_len": int(q),
                    "prefix_len": int(p),
                    "window": window,
                    "requests": 1,
                    "vision_tokens": int((types_cpu > 0).sum()),
                    "image_tokens": image_tokens,
                }
                out_bytes = gemma_mask_traffic([q], [p])["output_bytes"]
                for impl in impls:
                    row: dict[str, Any] = {
                        "kernel": "gemma_mask",
                        "impl": impl,
                        "shape": dict(shape),
                        "status": "ok",
                        "message": None,
                        "device": str(dev),
                        "output_bytes": out_bytes,
                        "predicted_peak_bytes": gemma_mask_peak_bytes([q], [p], window, impl),
                        "peak_allocated_bytes": None,
                        "memory_available": cuda,
                        "median_ms": None,
                        "p10_ms": None,
                        "p90_ms": None,
                        "bound_ms": out_bytes / write_bw_bytes_s * 1e3,
                        "write_bw_bytes_s": write_bw_bytes_s,
                        "x_bound": None,
                        "device_median_ms": None,
                        "x_bound_device": None,
                        "repeats": repeats,
                        "budget_bytes": budget_bytes,
                        "true_count": None,
                    }
                    problem = _triton_unavailable(dev) if impl == "triton" else None
                    if problem:
                        row.update(status="error", message=problem)
                    elif not cuda and budget_bytes is not None and row["predicted_peak_bytes"] > budget_bytes:
                        row.update(
                            status="skipped",
                            message=f"predicted peak {row['predicted_peak_bytes'] / GiB:.2f} GiB > budget "
                            f"{budget_gib} GiB (no allocator cap on CPU)",
                        )
                    else:
                        types = types_cpu.to(dev)
                        oom = None
                        try:
                            row.update(
                                _measure(
                                    lambda t=types, q=q, p=p, impl=impl: build_gemma_attention_mask(
                                        t, [q], [p], window, impl=impl
                                    ),
                                    dev,
                                    repeats,
                                    warmup,
                                )
                            )
                            row["x_bound"] = row["median_ms"] / row["bound_ms"] if row["bound_ms"] else None
                            dm = row.get("device_median_ms")
                            row["x_bound_device"] = dm / row["bound_ms"] if dm and row["bound_ms"] else None
                        except torch.OutOfMemoryError as err:
                            oom = str(err).splitlines()[0][:300]
                        except Exception as err:  # recorded, the sweep goes on
                            row.update(
                                status="error", message=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                            )
                        if oom is not None:  # outside the except block: the traceback's frames are gone
                            row.update(status="oom", message=oom)
                        del types
                        _free(dev)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    finally:
        if cuda and budget_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return rows
