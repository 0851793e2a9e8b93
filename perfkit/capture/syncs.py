"""Device synchronisations per engine phase: torch's sync debug mode, attributed to the innermost open range.

    with SyncCounter(recorder):      # recorder: the RangeRecorder whose ranges wrap the engine phases
        ... run the scenario ...
    counter.summary(recorder.counts())   # {"prepare_inputs": {"total": 0, "per_call": 0.0}, ...}

Why: the page-table A/B (`page_table=host|padded`) is about host work that waits for the GPU. A sync in the
per-step path stalls the host (and, with overlapped steps, the overlap itself). `torch.cuda.set_sync_debug_mode
("warn")` makes torch emit a warning at every synchronising call it makes (`.item()`, `.tolist()`, `.cpu()` of a
device tensor, blocking copies, stream/device synchronize); this counts them per range instead of printing them.
Explicit waits outside torch's ops (an Event.synchronize the engine does on purpose to read sampled ids) are not
flagged by torch and so not counted.

Opt-in (`capture.sync_counts: true`): every flagged call goes through Python's warning machinery (microseconds),
so leave it off in timing runs where syncs are frequent (the padded arm).
"""

from __future__ import annotations

import warnings
from typing import Any

OUTSIDE = "(outside ranges)"


class SyncCounter:
    def __init__(self, ranges: Any, torch_module: Any = None):
        self.ranges = ranges  # needs `open_ranges` (RangeRecorder); a disabled recorder has none open
        self._torch = torch_module
        self.totals: dict[str, int] = {}
        self._catch: Any = None
        self._show: Any = None

    def _t(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            self._show(message, category, filename, lineno, file, line)  # not ours: show it as before
            return
        open_ = getattr(self.ranges, "open_ranges", None) or []
        name = open_[-1] if open_ else OUTSIDE
        self.totals[name] = self.totals.get(name, 0) + 1

    def __enter__(self) -> SyncCounter:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=".*synchroniz.*")  # default: once per call site
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning
        self._t().cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        self._t().cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)  # restores filters and showwarning

    def summary(self, calls: dict[str, int]) -> dict[str, dict[str, float]]:
        """{range: {"total": syncs, "per_call": syncs / occurrences}} for every range that ran (zeros included)
        and every range that synced."""
        out: dict[str, dict[str, float]] = {}
        for name in sorted(set(calls) | set(self.totals)):
            n = self.totals.get(name, 0)
            c = calls.get(name, 0)
            out[name] = {"total": n, "per_call": n / c if c else float(n)}
        return out
