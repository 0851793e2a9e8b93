"""Figures from result files: pure functions returning matplotlib Figures, and `plot_results` to write PNGs.

Never imports the runtime; uses the object API with an Agg canvas, so importing it changes no global state.
"""

from perfkit.plots.figures import (
    delta_bars,
    latency_cdf,
    mask_sweep,
    memory_by_phase,
    nvtx_ranges,
    save,
    throughput_points,
    throughput_vs_latency,
)
from perfkit.plots.report import plot_results, write_delta_plots

__all__ = [
    "delta_bars",
    "latency_cdf",
    "mask_sweep",
    "memory_by_phase",
    "nvtx_ranges",
    "plot_results",
    "save",
    "throughput_points",
    "throughput_vs_latency",
    "write_delta_plots",
]
