"""Profiler windows over engine steps.

    win = ProfileWindow(kind="torch", start_step=20, stop_step=25, out_dir=run_dir / "profiles", name="decode-A")
    for step_idx in itertools.count():
        win.on_step(step_idx)          # at the top of every engine step
        ... step ...
    win.close()                        # stops (and exports) a window the scenario ended inside

The window covers steps `start_step <= i < stop_step`. Kinds:
- `torch`: `torch.profiler` (CPU + CUDA activities) over the window, exported as a Chrome trace
  `<out_dir>/<name>.trace.json` (open in Perfetto / chrome://tracing), and summarised in `summary` (see
  `kernel_summary`: device kernel time per step, how busy the GPU was inside the window, the top kernels and a
  coarse split by kind), which the runner stores in the scenario's `runtime.profile`: where the time of a
  step goes, in the result file itself, without opening the trace.
- `cuda`: `torch.cuda.profiler.start()` / `stop()` (cudaProfilerStart/Stop) around the window, for
  `nsys profile -c cudaProfilerApi --capture-range-end=stop ...` or `ncu --profile-from-start off`.
  The device is synchronized at both edges so that the window holds exactly its steps' kernels.
- `python`: cProfile over the window (the host side: scheduler, page tables, plan(), launches), written as
  `<out_dir>/<name>.pstats` (`python -m pstats`, snakeviz) and summarised in `summary` (`host_summary`: the
  functions with the most cumulative host time per step).
- `none`: nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

ProfileKind = Literal["torch", "cuda", "python", "none"]

# Coarse kernel kinds by name (first match wins). Heuristic: cuBLAS/CUTLASS GEMM names and perfkit's Triton GEMMs,
# FlashInfer's attention kernels, PyTorch's copy / elementwise kernels (C++ names with "::"), then perfkit's other
# Triton kernels (plain Python names starting with "_").
_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("batchdecode", "batchprefill", "flashinfer", "mergestate", "merge_state", "_paged_decode",
                   "_merge_splits")),
    (
        "gemm",
        ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "_w4a16", "_fp8", "_moe_gather", "matmul", "cublas"),
    ),
    ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat")),
)


def kernel_kind(name: str) -> str:
    n = name.lower()
    for kind, keys in _KINDS:
        if any(k in n for k in keys):
            return kind
    if "::" in n:
        return "elementwise"  # at::native elementwise / reduce kernels
    if n.startswith("_") or "triton" in n:
        return "triton"
    return "other"


# Idle gaps up to this long between one kernel's end and the next one's start count as launch gaps: the device
# running a CUDA graph or a full stream queue back to back, with the few microseconds each launch costs. Longer
# ones are the device waiting on the host (a sync, plan(), Python between steps). A heuristic threshold, not a
# hardware constant: it splits a window's idle time into "many tiny kernels" (fewer, fused kernels help) and
# "host-bound" (host work or overlap helps).
LAUNCH_GAP_MAX_US = 5.0


def kernel_summary(kernels: Iterable[tuple[str, float, float]], steps: int, top: int = 25) -> dict[str, Any]:
    """Summary of the device activity of a profiler window. `kernels`: (name, start_us, end_us) per kernel or
    memcpy on the device timeline; `steps`: engine steps in the window.

    - `device_busy_ms`: union of the kernel intervals (overlaps counted once); `window_ms`: first start to last
      end; `busy_fraction` = busy / window: the rest is the device idling on the host (launch gaps, host work
      between steps, syncs). Per-step numbers divide by `steps`.
    - `idle_gaps`: that idle time split at LAUNCH_GAP_MAX_US into launch gaps (count and ms per step) and host
      gaps (count, ms per step, the longest in µs).
    - `by_kind`: total kernel ms per coarse kind (kernel_kind); `top`: the kernels with the most total time."""
    ks = sorted((float(s), float(e), n) for n, s, e in kernels)
    if not ks:
        return {"steps": steps, "kernels": 0, "note": "no device kernels recorded (CPU run or no CUDA activity)"}
    busy = 0.0
    gaps: list[float] = []  # us between merged busy intervals
    cur_s, cur_e = ks[0][0], ks[0][1]
    for s, e, _ in ks[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = max(e for _, e, _ in ks) - ks[0][0]
    launch = [g for g in gaps if g <= LAUNCH_GAP_MAX_US]
    host = [g for g in gaps if g > LAUNCH_GAP_MAX_US]
    per_name: dict[str, list[float]] = {}
    by_kind: dict[str, float] = {}
    for s, e, n in ks:
        agg = per_name.setdefault(n, [0, 0.0])
        agg[0] += 1
        agg[1] += e - s
    for n, (_, t) in per_name.items():  # one kind lookup per distinct name, not per launch
        kind = kernel_kind(n)
        by_kind[kind] = by_kind.get(kind, 0.0) + t
    n_steps = max(1, steps)
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "steps": steps,
        "kernels": len(ks),
        "kernels_per_step": len(ks) / n_steps,
        "window_ms": window / 1e3,
        "device_busy_ms": busy / 1e3,
        "busy_fraction": busy / window if window > 0 else 1.0,
        "device_busy_ms_per_step": busy / 1e3 / n_steps,
        "idle_ms_per_step": (window - busy) / 1e3 / n_steps,
        "idle_gaps": {
            "launch_gap_max_us": LAUNCH_GAP_MAX_US,
            "launch_gaps_per_step": len(launch) / n_steps,
            "launch_gap_ms_per_step": sum(launch) / 1e3 / n_steps,
            "host_gaps_per_step": len(host) / n_steps,
            "host_gap_ms_per_step": sum(host) / 1e3 / n_steps,
            "longest_gap_us": max(gaps, default=0.0),
        },
        "by_kind_ms_per_step": {k: v / 1e3 / n_steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [
            {"name": n[:160], "kind": kernel_kind(n), "count": int(c), "total_ms": t / 1e3, "mean_us": t / c}
            for n, (c, t) in ranked
        ],
    }


class ProfileWindow:
    """Starts a profiler at `start_step` and stops it at `stop_step` (see module docstring)."""

    def __init__(
        self,
        kind: ProfileKind = "none",
        start_step: int = 0,
        stop_step: int = 0,
        out_dir: str | Path = ".",
        name: str = "profile",
        record_shapes: bool = False,
        with_stack: bool = False,
        torch_module: Any = None,
    ):
        if kind not in ("torch", "cuda", "python", "none"):
            raise ValueError(f"profile kind {kind!r}; allowed: torch, cuda, python, none")
        if kind != "none" and not 0 <= start_step < stop_step:
            raise ValueError(f"profile window needs 0 <= start_step < stop_step, got {start_step}..{stop_step}")
        self.kind = kind
        self.start_step = start_step
        self.stop_step = stop_step
        self.out_dir = Path(out_dir)
        self.name = name
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self._torch = torch_module
        self._prof: Any = None
        self.active = False
        self.done = kind == "none"
        self.trace_path: Path | None = None
        self.summary: dict[str, Any] | None = None

    def _t(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def on_step(self, step_idx: int) -> None:
        """Call at the top of every step; starts / stops the profiler at the window's edges."""
        if self.done:
            return
        if self.active:
            if step_idx >= self.stop_step:
                self.stop()
        elif self.start_step <= step_idx < self.stop_step:
            self.start()

    def start(self) -> None:
        if self.active or self.done:
            return
        torch = self._t()
        if self.kind == "torch":
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=acts, record_shapes=self.record_shapes, with_stack=self.with_stack
            )
            self._prof.start()
        elif self.kind == "cuda":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
        elif self.kind == "python":
            import cProfile

            self._prof = cProfile.Profile()
            self._prof.enable()
        self.active = True

    def stop(self) -> Path | None:
        """Stop the profiler (exporting the torch trace); returns the trace path for `torch`."""
        if not self.active:
            return self.trace_path
        torch = self._t()
        if self.kind == "torch":
            self._prof.stop()
            self.summary = kernel_summary(_device_events(self._prof, torch), self.stop_step - self.start_step)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.trace_path = self.out_dir / f"{self.name}.trace.json"
            self._prof.export_chrome_trace(str(self.trace_path))
            self._prof = None
        elif self.kind == "cuda":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
        elif self.kind == "python":
            import pstats

            self._prof.disable()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.trace_path = self.out_dir / f"{self.name}.pstats"
            self._prof.dump_stats(str(self.trace_path))
            self.summary = host_summary(pstats.Stats(self._prof), self.stop_step - self.start_step)
            self._prof = None
        self.active = False
        self.done = True
        return self.trace_path

    def close(self) -> Path | None:
        """End of scenario: stop a window still open."""
        return self.stop()

    def __enter__(self) -> ProfileWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_summary(stats: Any, steps: int, top: int = 30) -> dict[str, Any]:
    """The `top` functions by cumulative host time in a `pstats.Stats`, per step: where a step's host time goes
    (cumulative includes callees, so the engine's phases rank first, then what inside them costs)."""
    n = max(1, steps)
    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        rows.append((cumtime, tottime, ncalls, f"{Path(file).name}:{line}({func})"))
    rows.sort(reverse=True)
    total = max((r[0] for r in rows), default=0.0)
    return {
        "steps": steps,
        "host_ms_per_step": total * 1e3 / n,
        "top": [
            {
                "function": name[:160],
                "calls_per_step": nc / n,
                "cum_ms_per_step": cum * 1e3 / n,
                "self_ms_per_step": tot * 1e3 / n,
            }
            for cum, tot, nc, name in rows[:top]
        ],  # fmt: skip
    }


def _device_events(prof: Any, torch: Any) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every event of a stopped torch.profiler run on a CUDA device timeline."""
    cuda = torch.autograd.DeviceType.CUDA
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) == cuda:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out
