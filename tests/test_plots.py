"""perfkit.plots: every figure has its labelled axes, writes a PNG, and plot_results draws what fits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from factories import GIB, ab_run, config, requests_for, scenario_from_requests, write_run

from perfkit import plots
from perfkit.compare import compare
from perfkit.results import KernelRow, MemorySection, PhaseMemory, RangeStats, read_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _labels(fig) -> list[tuple[str, str]]:
    return [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]


def _check_png(fig, path: Path) -> None:
    assert tuple(fig.get_size_inches()) == (8.0, 4.5) and fig.dpi == 150
    out = plots.save(fig, path)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def _legend_texts(ax) -> list[str]:
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg is not None else []


def test_latency_cdf(tmp_path):
    rng = np.random.default_rng(0)
    series = {
        arm: requests_for("decode", arm, 0, 50 * rng.lognormal(0, 0.2, 40) * s, 10 * rng.lognormal(0, 0.1, 40) * s)
        for arm, s in (("triton", 1.0), ("dense", 1.1))
    }
    fig = plots.latency_cdf(series, title="decode")
    assert _labels(fig) == [("TTFT (ms)", "fraction of requests (CDF)"), ("TPOT (ms)", "fraction of requests (CDF)")]
    assert _legend_texts(fig.axes[0]) == ["triton (n=40)", "dense (n=40)"]
    _check_png(fig, tmp_path / "cdf.png")


def test_delta_bars(tmp_path):
    report = compare(ab_run(tmp_path / "r", repeats=3, n=40, shift=0.1))
    rows = report.comparisons[0].rows
    fig = plots.delta_bars(rows, title="decode")
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Δ % of B vs A (95% CI)", "metric")
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "TTFT p50 (ms)"
    assert "95% CI" in _legend_texts(ax) and "worse" in _legend_texts(ax)
    _check_png(fig, tmp_path / "delta.png")


def _concurrency_run(tmp: Path) -> Path:
    scen_cfg, scen, reqs = [], [], []
    for c in (1, 4, 16):
        name = f"decode_c{c}"
        scen_cfg.append({"name": name, "arrival": {"kind": "closed", "concurrency": c}})
        for arm, speed in (("triton", 1.0), ("dense", 0.9)):
            r = requests_for(name, arm, 0, np.full(10, 20.0 * c), np.full(10, (8.0 + c * 0.5) / speed))
            s = scenario_from_requests(name, arm, 0, r)
            s.throughput.output_tok_s = c * 1000.0 / ((8.0 + c * 0.5) / speed)
            scen.append(s)
            reqs += r
    scen_cfg.append({"name": "poisson", "arrival": {"kind": "rate", "rate": 5.0}})
    r = requests_for("poisson", "triton", 0, np.full(5, 30.0), np.full(5, 9.0))
    scen.append(scenario_from_requests("poisson", "triton", 0, r))
    return write_run(tmp / "sweep", scen, reqs + r, cfg=config(scenarios=scen_cfg))


def test_throughput_vs_latency(tmp_path):
    res = read_result(_concurrency_run(tmp_path))
    pts = plots.throughput_points(res)
    assert sorted(pts) == ["dense", "triton"]
    assert [c for c, _, _ in pts["triton"]] == [1, 4, 16]  # the open-loop scenario is not a concurrency point
    fig = plots.throughput_vs_latency(pts)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "per-user output (tok/s, 1000 / median TPOT)"
    assert ax.get_ylabel() == "output throughput (tok/s)"
    assert _legend_texts(ax) == ["triton", "dense"]
    np.testing.assert_allclose(ax.lines[0].get_xdata(), [1000 / 8.5, 1000 / 10.0, 1000 / 16.0])
    _check_png(fig, tmp_path / "tl.png")
    fig = plots.throughput_vs_latency(pts, x="tpot_ms")
    assert fig.axes[0].get_xlabel() == "median TPOT (ms)"


def test_throughput_vs_latency_of_a_several_model_suite(tmp_path):
    """b200_nvfp4's shape: one file, two models, scenario results named "<model>/<scenario>". Each model is its own
    curve (it was one mixed curve, or none: the prefixed names missed the config's concurrency), and a two-file
    delta plot's title names the scenario's models and the two files."""
    models = [{"preset": "31b", "quant": "nvfp4"}, {"preset": "26b-a4b", "quant": "nvfp4"}]
    scen_cfg = [{"name": f"c{c}", "arrival": {"kind": "closed", "concurrency": c}} for c in (1, 8)]
    cfg = config(scenarios=scen_cfg) | {"models": models}
    scen, reqs = [], []
    for m, tpot in (("31b", 12.0), ("26b-a4b", 5.0)):
        for c in (1, 8):
            r = requests_for(f"{m}/c{c}", "default", 0, np.full(6, 100.0), np.full(6, tpot * (1 + c / 8)))
            scen.append(scenario_from_requests(f"{m}/c{c}", "default", 0, r))
            reqs += r
    path = write_run(tmp_path / "suite", scen, reqs, cfg=cfg)
    pts = plots.throughput_points(read_result(path))
    assert sorted(pts) == ["26b-a4b nvfp4 · default", "31b nvfp4 · default"]
    assert [c for c, _, _ in pts["31b nvfp4 · default"]] == [1, 8]
    other = write_run(tmp_path / "other", scen, reqs, cfg=cfg | {"models": models[:1] + [models[1] | {"quant": "fp8"}]})
    written = plots.plot_results([path, other], tmp_path / "png")
    assert tmp_path / "png" / "throughput_vs_latency.png" in written
    (title,) = [
        t for t, _ in plots.write_delta_plots(compare(path, other), tmp_path / "d") if t.startswith("26b-a4b/c8")
    ]
    assert title.splitlines() == ["26b-a4b/c8 (26b-a4b nvfp4 → 26b-a4b fp8)", "A = suite, B = other"]
    from perfkit.plots.report import _sides

    labels = {(scen, label) for label, scen, _, _ in _sides([(read_result(p), []) for p in (path, other)])}
    assert ("26b-a4b/c1", "other · 26b-a4b fp8") in labels and ("31b/c1", "other") in labels  # named where differ


def test_memory_by_phase(tmp_path):
    def mem(scale: float) -> MemorySection:
        return MemorySection(
            available=True,
            phases={
                ph: PhaseMemory(
                    peak_allocated_bytes=int(v * scale * GIB), peak_reserved_bytes=int((v + 2) * scale * GIB)
                )
                for ph, v in (("warmup", 10), ("prefill", 30), ("decode", 24))
            },
        )

    fig = plots.memory_by_phase({"triton": mem(1.0), "dense": mem(1.2)})
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("phase", "peak CUDA memory (GiB)")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["warmup", "prefill", "decode"]
    assert "dense reserved" in _legend_texts(ax)
    assert max(p.get_height() for p in ax.patches if np.isfinite(p.get_height())) == pytest.approx(1.2 * 32)
    _check_png(fig, tmp_path / "mem.png")


def _mask_rows() -> list[KernelRow]:
    rows = []
    for q in (1024, 4096, 16384, 65536):
        for impl in ("dense", "triton"):
            oom = impl == "dense" and q == 65536
            rows.append(
                KernelRow(
                    kernel="gemma_mask",
                    impl=impl,
                    shape={"q_len": q, "prefix_len": 0, "window": 1024},
                    status="oom" if oom else "ok",
                    message="CUDA out of memory" if oom else None,
                    peak_allocated_bytes=None if oom else (q * q * 2 if impl == "dense" else q * 64),
                    median_ms=None if oom else (q / 1000 if impl == "dense" else q / 20000),
                    p10_ms=None if oom else (q / 1100 if impl == "dense" else q / 22000),
                    p90_ms=None if oom else (q / 900 if impl == "dense" else q / 18000),
                )
            )
    return rows


def test_mask_sweep_marks_oom(tmp_path):
    fig = plots.mask_sweep(_mask_rows())
    assert _labels(fig) == [
        ("sequence length (prefix + q tokens)", "peak memory (GiB)"),
        ("sequence length (prefix + q tokens)", "median latency (ms, p10-p90)"),
    ]
    for ax in fig.axes:
        texts = _legend_texts(ax)
        assert "dense" in texts and "triton" in texts and "OOM" in texts
        oom = [ln for ln in ax.lines if ln.get_label() == "OOM"]
        assert len(oom) == 1 and oom[0].get_xdata()[0] == 65536
    _check_png(fig, tmp_path / "mask.png")


def test_mask_sweep_predicted_memory_on_cpu():
    rows = [r.model_copy(update={"peak_allocated_bytes": None}) for r in _mask_rows()]
    for r in rows:
        r.__pydantic_extra__["predicted_peak_bytes"] = 10 * GIB
    fig = plots.mask_sweep(rows)
    assert fig.axes[0].get_ylabel() == "peak memory (GiB, predicted where unmeasured)"


def test_nvtx_ranges(tmp_path):
    def rs(h: float, d: float | None) -> RangeStats:
        return RangeStats(count=3, host_total_ms=3 * h, host_mean_ms=h, host_p50_ms=h, host_p99_ms=h, device_mean_ms=d)

    fig = plots.nvtx_ranges(
        {
            "A": {"forward": rs(6, 5.5), "sample": rs(0.4, None)},
            "B": {"forward": rs(6.6, 6), "sample": rs(0.4, None), "mask": rs(1.0, 0.9)},
        }
    )
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("mean time per call (ms)", "NVTX range")
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "forward"
    assert {"A host", "A device", "B host", "B device"} <= set(_legend_texts(ax))
    _check_png(fig, tmp_path / "nvtx.png")


def test_plot_results_draws_what_fits(tmp_path):
    out = tmp_path / "figs"
    written = plots.plot_results([ab_run(tmp_path / "ab", repeats=1, n=30, shift=0.1)], out)
    assert sorted(p.name for p in written) == [
        "decode_cdf.png",
        "decode_dense_vs_triton_delta.png",
        "decode_memory.png",
        "decode_nvtx.png",
    ]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)
    sweep = plots.plot_results([_concurrency_run(tmp_path)], tmp_path / "sweep_figs")
    assert "throughput_vs_latency.png" in {p.name for p in sweep}
    kpath = write_run(tmp_path / "kern", [], [], cfg={"kernel": "gemma_mask"}, kernels=_mask_rows())
    assert [p.name for p in plots.plot_results([kpath], tmp_path / "kfigs")] == ["mask_sweep.png"]
    two = plots.plot_results([ab_run(tmp_path / "a1", n=20), ab_run(tmp_path / "b1", n=20, seed=1)], tmp_path / "two")
    assert "decode_triton_vs_triton_delta.png" in {p.name for p in two}


def test_plots_import_has_no_side_effects():
    code = (
        "import sys, matplotlib; b = matplotlib.get_backend.__module__; import perfkit.plots, perfkit.compare; "
        "assert 'matplotlib.pyplot' not in sys.modules; "
        "assert not any(m.startswith('perfkit.runtime') for m in sys.modules); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
