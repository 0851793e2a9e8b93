"""Profiler windows over engine steps.

    win = ProfileWindow(kind="torch", start_step=20, stop_step=25, out_dir=run_dir / "profiles", name="decode-A")
    for step_idx in itertools.count():
        win.on_step(step_idx)          # at the top of every engine step
        ... step ...
    win.close()                        # stops (and exports) a window the scenario ended inside

The window covers steps `start_step <= i < stop_step`. Kinds:
- `torch`: `torch.profiler` (CPU + CUDA activities) over the window, exported as a Chrome trace
  `<out_dir>/<name>.trace.json` (open in Perfetto / chrome://tracing).
- `cuda`: `torch.cuda.profiler.start()` / `stop()` (cudaProfilerStart/Stop) around the window, for
  `nsys profile -c cudaProfilerApi --capture-range-end=stop ...` or `ncu --profile-from-start off`.
  The device is synchronized at both edges so that the window holds exactly its steps' kernels.
- `none`: nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

ProfileKind = Literal["torch", "cuda", "none"]


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
        if kind not in ("torch", "cuda", "none"):
            raise ValueError(f"profile kind {kind!r}; allowed: torch, cuda, none")
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
        self.active = True

    def stop(self) -> Path | None:
        """Stop the profiler (exporting the torch trace); returns the trace path for `torch`."""
        if not self.active:
            return self.trace_path
        torch = self._t()
        if self.kind == "torch":
            self._prof.stop()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.trace_path = self.out_dir / f"{self.name}.trace.json"
            self._prof.export_chrome_trace(str(self.trace_path))
            self._prof = None
        elif self.kind == "cuda":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
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
