"""`plot_results`: draw every figure that fits the given result files into a directory of PNGs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perfkit.errors import PerfkitError
from perfkit.plots import figures as F
from perfkit.results import RangeStats, Result, ScenarioResult, read_requests, read_result, scenario_model


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "plot"


def _mean_ranges(reps: list[ScenarioResult]) -> dict[str, RangeStats]:
    """NVTX ranges averaged over repeats (mean of per-repeat means)."""
    out: dict[str, RangeStats] = {}
    for name in dict.fromkeys(n for s in reps for n in s.nvtx):
        rs = [s.nvtx[name] for s in reps if name in s.nvtx]
        dev = [r.device_mean_ms for r in rs if r.device_mean_ms is not None]
        out[name] = rs[0].model_copy(
            update={
                "host_mean_ms": float(np.mean([r.host_mean_ms for r in rs])),
                "host_total_ms": float(np.mean([r.host_total_ms for r in rs])),
                "device_mean_ms": float(np.mean(dev)) if dev else None,
            }
        )
    return out


def _sides(loaded: list[tuple[Result, list[dict[str, Any]]]]) -> list[tuple[str, str, list[ScenarioResult], list]]:
    """(label, scenario, ok repeats, requests) per (file, scenario, arm); labels unique across files, and naming
    the model where the files ran the scenario on different ones."""
    out = []
    many = len(loaded) > 1
    models: dict[str, set[str | None]] = {}
    for res, _ in loaded:
        for s in res.scenarios:
            models.setdefault(s.name, set()).add(scenario_model(res.config, s.name, always=True))
    for res, reqs in loaded:
        arms = list(dict.fromkeys(s.arm_name for s in res.scenarios))
        for scen in dict.fromkeys(s.name for s in res.scenarios):
            for arm in arms:
                reps = [s for s in res.scenarios if s.name == scen and s.arm_name == arm and s.status == "ok"]
                if not reps:
                    continue
                label = arm if not many else (res.run_id if len(arms) == 1 else f"{res.run_id} · {arm}")
                if many and len(models[scen]) > 1:
                    label += f" · {scenario_model(res.config, scen, always=True)}"
                rq = [r for r in reqs if r.get("scenario") == scen and r.get("arm") in (arm, reps[0].arm)]
                out.append((label, scen, reps, rq))
    return out


def plot_results(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the figures that fit: TTFT/TPOT CDFs, delta bars (two sides), throughput vs latency across
    concurrency, memory by phase, NVTX ranges, mask sweep. Returns the PNG paths."""
    if not paths:
        raise PerfkitError("plot: give at least one result file")
    out = Path(out_dir)
    loaded = []
    for p in paths:
        res = read_result(p)
        loaded.append((res, read_requests(Path(p) if Path(p).is_dir() else Path(p).parent)))
    written: list[Path] = []
    sides = _sides(loaded)
    for scen in dict.fromkeys(s[1] for s in sides):
        mine = [s for s in sides if s[1] == scen]
        cdf = {label: rq for label, _, _, rq in mine if rq}
        if cdf:
            written.append(F.save(F.latency_cdf(cdf, title=f"{scen}: TTFT and TPOT"), out / f"{_slug(scen)}_cdf.png"))
        mem = {
            label: reps[0].memory
            for label, _, reps, _ in mine
            if reps[0].memory is not None and reps[0].memory.available and reps[0].memory.phases
        }
        if mem:
            written.append(
                F.save(F.memory_by_phase(mem, title=f"{scen}: peak memory by phase"), out / f"{_slug(scen)}_memory.png")
            )
        nv = {label: _mean_ranges(reps) for label, _, reps, _ in mine if any(s.nvtx for s in reps)}
        if nv:
            written.append(F.save(F.nvtx_ranges(nv, title=f"{scen}: NVTX range time"), out / f"{_slug(scen)}_nvtx.png"))
    tl: dict[str, list[tuple[int, float, float]]] = {}
    for res, _ in loaded:
        for curve, pts in F.throughput_points(res, with_model=len(loaded) > 1).items():
            tl[curve if len(loaded) == 1 else f"{res.run_id} · {curve}"] = pts
    if any(len({c for c, _, _ in pts}) >= 2 for pts in tl.values()):
        written.append(F.save(F.throughput_vs_latency(tl), out / "throughput_vs_latency.png"))
    for res, _ in loaded:
        rows = [r for r in (res.kernels or []) if r.kernel == "gemma_mask"]
        if rows:
            name = "mask_sweep.png" if len(loaded) == 1 else f"{_slug(res.run_id)}_mask_sweep.png"
            written.append(F.save(F.mask_sweep(rows, title=f"gemma_mask sweep ({res.run_id})"), out / name))
    n_arms = len({s.arm_name for s in loaded[0][0].scenarios})
    if (len(loaded) == 2 or (len(loaded) == 1 and n_arms >= 2)) and loaded[0][0].scenarios:
        from perfkit.compare import compare

        report = compare(paths[0], paths[1] if len(loaded) == 2 else None)
        written += [p for _, p in write_delta_plots(report, out)]
    return written


def write_delta_plots(report: Any, out_dir: str | Path) -> list[tuple[str, Path]]:
    """One delta-bar figure per comparison of a `perfkit.compare.Report`: [(title, path)]."""
    out = []
    from perfkit.compare import comparison_title

    for c in report.comparisons:
        title = comparison_title(report, c).replace("`", "").replace(" · ", "\n", 1)  # scenario, then the sides
        fig = F.delta_bars(c.rows, title=title, confidence=report.confidence)
        name = f"{_slug(c.scenario)}_{_slug(c.b.arm)}_vs_{_slug(c.a.arm)}_delta.png"
        out.append((title, F.save(fig, Path(out_dir) / name)))
    return out
