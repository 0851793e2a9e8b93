"""Pure plotting functions: result data in, matplotlib `Figure` out (object API, Agg canvas, no pyplot state).

Every figure is sized for a PR page (8 x 4.5 in at 150 dpi), has labelled axes with units and a legend.
Nothing here imports the runtime; inputs are `perfkit.results` objects, per-request dicts and plain rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from perfkit.results import (
    KernelRow,
    MemorySection,
    RangeStats,
    Result,
    ScenarioResult,
    scenario_model,
    suite_models,
    suite_scenario_name,
)

FIGSIZE = (8.0, 4.5)
DPI = 150
GIB = 2**30
VERDICT_COLOR = {"better": "#2e7d32", "worse": "#c62828", "no significant change": "#9e9e9e", "n/a": "#bdbdbd"}
OOM_COLOR = "#c62828"


def new_figure(ncols: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def save(fig: Figure, path: str | Path) -> Path:
    """Write a PNG through the Agg canvas (no global backend switch)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(p))
    return p


def _cdf(ax: Any, values: np.ndarray, label: str) -> None:
    x = np.sort(values)
    y = np.arange(1, x.size + 1) / x.size
    ax.step(x, y, where="post", label=f"{label} (n={x.size})")


def latency_cdf(series: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "") -> Figure:
    """TTFT and TPOT CDFs, one line per series (label -> per-request dicts from requests.jsonl)."""
    fig, (ax_ttft, ax_tpot) = new_figure(2)
    for ax, key, name in ((ax_ttft, "ttft_ms", "TTFT"), (ax_tpot, "tpot_ms", "TPOT")):
        for label, reqs in series.items():
            v = np.asarray([r[key] for r in reqs if r.get(key) is not None], dtype=float)
            if v.size:
                _cdf(ax, v, label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests (CDF)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(name)
        if ax.lines:
            ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return fig


class DeltaRowLike(Protocol):
    label: str
    unit: str
    delta_pct: float | None
    lo_pct: float | None
    hi_pct: float | None
    verdict: str


def delta_bars(rows: Sequence[DeltaRowLike], title: str = "", confidence: float = 0.95) -> Figure:
    """Horizontal bars of delta % per metric with CI whiskers, coloured by verdict (B against A)."""
    rows = [r for r in rows if r.delta_pct is not None and math.isfinite(r.delta_pct)]
    fig, (ax,) = new_figure(1)
    y = np.arange(len(rows))[::-1]
    d = np.array([r.delta_pct for r in rows], dtype=float)
    ax.barh(y, d, color=[VERDICT_COLOR.get(r.verdict, "#bdbdbd") for r in rows], height=0.7)
    with_ci = [i for i, r in enumerate(rows) if r.lo_pct is not None and r.hi_pct is not None]
    if with_ci:
        lo = np.array([rows[i].lo_pct for i in with_ci], dtype=float)
        hi = np.array([rows[i].hi_pct for i in with_ci], dtype=float)
        ax.errorbar(
            d[with_ci],
            y[with_ci],
            xerr=[np.clip(d[with_ci] - lo, 0, None), np.clip(hi - d[with_ci], 0, None)],
            fmt="none",
            ecolor="black",
            capsize=3,
            lw=1,
            label=f"{int(round(confidence * 100))}% CI",
        )
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, [f"{r.label} ({r.unit})" for r in rows], fontsize=7)
    ax.set_xlabel(f"Δ % of B vs A ({int(round(confidence * 100))}% CI)")
    ax.set_ylabel("metric")
    for verdict, color in VERDICT_COLOR.items():
        if any(r.verdict == verdict for r in rows):
            ax.barh([np.nan], [np.nan], color=color, label=verdict)
    ax.legend(fontsize=7, loc="best")
    ax.grid(axis="x", alpha=0.3)
    if title:  # over the whole figure: the long metric labels push the axes right, an axes title would clip
        fig.suptitle(title, fontsize=10)
    return fig


def scenario_concurrency(result: Result, s: ScenarioResult) -> int | None:
    """Closed-loop concurrency of a scenario (config arrival, else workload spec / runtime), None otherwise."""
    name = suite_scenario_name(result.config, s.name)  # "31b/c64" in a several-model suite is the config's "c64"
    for sc in result.config.get("scenarios") or []:
        if isinstance(sc, dict) and sc.get("name") == name:
            arr = sc.get("arrival") or {}
            if arr.get("kind", "closed") == "closed" and arr.get("concurrency") is not None:
                return int(arr["concurrency"])
            return None
    for src in ((s.workload.spec if s.workload else {}).get("arrival") or {}, s.runtime):
        if isinstance(src, dict) and src.get("kind", "closed") == "closed" and src.get("concurrency") is not None:
            return int(src["concurrency"])
    return None


def throughput_points(result: Result, with_model: bool = False) -> dict[str, list[tuple[int, float, float]]]:
    """curve -> [(concurrency, median TPOT ms, output tok/s)] over closed-loop ok scenarios, medians over repeats.
    One curve per arm, per model and arm in a several-model suite ("31b nvfp4 · default"); ``with_model`` names the
    model of a one-model suite too (several files side by side)."""
    several = len(suite_models(result.config)) > 1
    acc: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in result.scenarios:
        c = scenario_concurrency(result, s)
        tpot = s.metrics.get("tpot_ms")
        if s.status != "ok" or c is None or s.throughput is None or tpot is None or tpot.p50 is None:
            continue
        model = scenario_model(result.config, s.name, always=True) if several or with_model else None
        curve = s.arm_name if model is None else f"{model} · {s.arm_name}"
        acc.setdefault((curve, c), []).append((tpot.p50, s.throughput.output_tok_s))
    out: dict[str, list[tuple[int, float, float]]] = {}
    for (arm, c), vals in acc.items():
        v = np.asarray(vals)
        out.setdefault(arm, []).append((c, float(np.median(v[:, 0])), float(np.median(v[:, 1]))))
    return {arm: sorted(pts) for arm, pts in out.items()}


def throughput_vs_latency(
    series: Mapping[str, Sequence[tuple[int, float, float]]], x: str = "per_user_tok_s", title: str = ""
) -> Figure:
    """Output tok/s against per-user tok/s (1000 / median TPOT) or TPOT, one curve per arm, points = concurrency."""
    fig, (ax,) = new_figure(1)
    for label, pts in series.items():
        pts = sorted(pts)
        xs = [1000.0 / p[1] if x == "per_user_tok_s" else p[1] for p in pts]
        ys = [p[2] for p in pts]
        ax.plot(xs, ys, marker="o", label=label)
        for (c, _, _), xi, yi in zip(pts, xs, ys, strict=True):
            ax.annotate(f"c={c}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user output (tok/s, 1000 / median TPOT)" if x == "per_user_tok_s" else "median TPOT (ms)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "throughput vs latency across concurrency")
    return fig


def memory_by_phase(series: Mapping[str, MemorySection], title: str = "") -> Figure:
    """Grouped bars per phase: peak allocated (solid) and reserved (outline) GiB, one colour per series."""
    fig, (ax,) = new_figure(1)
    phases = list(dict.fromkeys(ph for m in series.values() if m.available for ph in m.phases))
    n = max(1, len(series))
    width = 0.8 / n
    x = np.arange(len(phases))
    for i, (label, mem) in enumerate(series.items()):
        alloc = [mem.phases[p].peak_allocated_bytes / GIB if p in mem.phases else np.nan for p in phases]
        res = [mem.phases[p].peak_reserved_bytes / GIB if p in mem.phases else np.nan for p in phases]
        pos = x - 0.4 + width * (i + 0.5)
        bars = ax.bar(pos, alloc, width * 0.9, label=f"{label} allocated")
        ax.bar(
            pos,
            res,
            width * 0.9,
            fill=False,
            edgecolor=bars.patches[0].get_facecolor() if bars.patches else "k",
            linestyle="--",
            label=f"{label} reserved",
        )
    ax.set_xticks(x, phases)
    ax.set_xlabel("phase")
    ax.set_ylabel("peak CUDA memory (GiB)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or "peak memory by phase")
    return fig


def _row_get(row: KernelRow, key: str) -> Any:
    return getattr(row, key, None) if key in KernelRow.model_fields else (row.model_extra or {}).get(key)


def mask_sweep(rows: Sequence[KernelRow], title: str = "") -> Figure:
    """gemma_mask sweep: peak memory (left) and median latency with p10-p90 (right) against sequence length
    (prefix + q tokens), one curve per impl (and per prefix/window when several); OOM points marked with x."""
    rows = [r for r in rows if r.kernel == "gemma_mask"]
    fig, (ax_mem, ax_lat) = new_figure(2)
    prefixes = sorted({int(r.shape.get("prefix_len", 0)) for r in rows})
    windows = sorted({str(r.shape.get("window")) for r in rows})

    def key(r: KernelRow) -> str:
        k = r.impl
        if len(prefixes) > 1:
            k += f", prefix {r.shape.get('prefix_len', 0)}"
        if len(windows) > 1:
            k += f", window {r.shape.get('window')}"
        return k

    groups: dict[str, list[KernelRow]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    predicted = False
    oom_x: list[tuple[Any, float]] = []
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: int(r.shape.get("q_len", 0)) + int(r.shape.get("prefix_len", 0)))
        seq = [int(r.shape.get("q_len", 0)) + int(r.shape.get("prefix_len", 0)) for r in rs]
        ok = [r.status == "ok" for r in rs]
        mem = []
        for r in rs:
            b = r.peak_allocated_bytes
            if b is None and _row_get(r, "predicted_peak_bytes") is not None:
                b, predicted = _row_get(r, "predicted_peak_bytes"), True
            mem.append(b / GIB if b is not None and r.status == "ok" else np.nan)
        lat = [r.median_ms if r.median_ms is not None and r.status == "ok" else np.nan for r in rs]
        (line,) = ax_mem.plot(seq, mem, marker="o", label=label)
        color = line.get_color()
        med = np.asarray(lat, dtype=float)
        lo = np.asarray([r.p10_ms if r.p10_ms is not None else m for r, m in zip(rs, med, strict=True)], dtype=float)
        hi = np.asarray([r.p90_ms if r.p90_ms is not None else m for r, m in zip(rs, med, strict=True)], dtype=float)
        ax_lat.errorbar(
            seq,
            med,
            yerr=[np.clip(med - lo, 0, None), np.clip(hi - med, 0, None)],
            marker="o",
            color=color,
            capsize=2,
            label=label,
        )
        oom_x += [(color, s) for s, good, r in zip(seq, ok, rs, strict=True) if not good and r.status == "oom"]
    for ax in (ax_mem, ax_lat):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
        ax.set_xlabel("sequence length (prefix + q tokens)")
        ax.grid(alpha=0.3, which="both")
        if any(np.isfinite(np.asarray(ln.get_ydata(), dtype=float)).any() for ln in ax.lines):
            ax.set_yscale("log")
        for i, (color, s) in enumerate(oom_x):
            ax.plot(
                [s],
                [0.95],
                marker="x",
                markersize=9,
                mew=2,
                color=color,
                linestyle="none",
                transform=ax.get_xaxis_transform(),
                label="OOM" if i == 0 else None,
            )
        ax.legend(fontsize=7)
    ax_mem.set_ylabel("peak memory (GiB" + (", predicted where unmeasured)" if predicted else ")"))
    ax_lat.set_ylabel("median latency (ms, p10-p90)")
    ax_mem.set_title("mask peak memory")
    ax_lat.set_title("mask latency")
    if title:
        fig.suptitle(title)
    return fig


def nvtx_ranges(series: Mapping[str, Mapping[str, RangeStats]], top: int = 15, title: str = "") -> Figure:
    """Mean time per NVTX range, one bar per series (host solid, device hatched), the `top` slowest ranges."""
    fig, (ax,) = new_figure(1)
    first = next(iter(series.values()), {})
    names = sorted(
        {n for s in series.values() for n in s}, key=lambda n: -(first[n].host_total_ms if n in first else 0.0)
    )[:top]
    y = np.arange(len(names))[::-1]
    k = max(1, len(series))
    h = 0.8 / k
    for i, (label, ranges) in enumerate(series.items()):
        pos = y + 0.4 - h * (i + 0.5)
        host = [ranges[n].host_mean_ms if n in ranges else np.nan for n in names]
        bars = ax.barh(pos, host, h * 0.9, label=f"{label} host")
        dev = [
            ranges[n].device_mean_ms if n in ranges and ranges[n].device_mean_ms is not None else np.nan for n in names
        ]
        if np.isfinite(np.asarray(dev, dtype=float)).any():
            ax.barh(
                pos,
                dev,
                h * 0.45,
                color="none",
                hatch="///",
                edgecolor=bars.patches[0].get_facecolor() if bars.patches else "k",
                label=f"{label} device",
            )
    ax.set_yticks(y, names, fontsize=7)
    ax.set_xlabel("mean time per call (ms)")
    ax.set_ylabel("NVTX range")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or "NVTX range time")
    return fig
