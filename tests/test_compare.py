"""perfkit.compare: alignment, verdicts, comparability warnings, --fail-if, Markdown golden files, CLI."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from factories import GIB, ab_run, config, provenance, requests_for, scenario_from_requests, write_run
from typer.testing import CliRunner

from perfkit import compare as cmp
from perfkit.errors import PerfkitError

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PERFKIT_UPDATE_GOLDEN") == "1"


def _fixed(n: int, base: float, step: float, mod: int) -> np.ndarray:
    """Deterministic spread of values without an RNG: base + step * ((7 i) mod `mod`)."""
    return base + step * ((7 * np.arange(n)) % mod)


def _single_run(tmp: Path, name: str, scale: float, prov: dict, hash_: str = "w0", arm: str = "default") -> Path:
    scen, reqs = [], []
    for sname, ttft0, tpot0 in (("decode", 40.0, 8.0), ("prefill", 300.0, 9.0)):
        r = requests_for(sname, arm, 0, _fixed(40, ttft0 * scale, 1.5, 11), _fixed(40, tpot0 * scale, 0.1, 13))
        reqs += r
        scen.append(
            scenario_from_requests(
                sname,
                arm,
                0,
                r,
                workload_hash=hash_,
                memory={"prefill": (int(30 * GIB * scale), 32 * GIB), "decode": (int(24 * GIB * scale), 32 * GIB)},
                nvtx={"forward": (6.0 * scale, 5.5 * scale), "sample": (0.4, None)},
            )
        )
    return write_run(tmp / name, scen, reqs, prov=prov, run_id=name)


def _interleaved_run(tmp: Path) -> Path:
    """3 interleaved repeats of A (triton) and B (dense); B is ~8 % slower with repeat-level drift."""
    scen, reqs = [], []
    drift = [1.0, 1.03, 0.98]
    for rep in range(3):
        for arm, scale in (("triton", 1.0), ("dense", 1.08)):
            s = scale * drift[rep]
            r = requests_for(
                "decode",
                arm,
                rep,
                _fixed(30, 40.0 * s, 1.0, 13) + rep,
                _fixed(30, 8.0 * s, 0.05, 9),
                t0_ns=rep * 10**10,
            )
            reqs += r
            scen.append(
                scenario_from_requests(
                    "decode",
                    arm,
                    rep,
                    r,
                    memory={"decode": (int(24 * GIB * scale), 32 * GIB)},
                    nvtx={"forward": (6.0 * s, 5.5 * s)},
                )
            )
    return write_run(tmp / "ab", scen, reqs, prov=provenance(sha="fedcba9876"))


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with PERFKIT_UPDATE_GOLDEN=1 if intended"


# ------------------------------------------------------------------------------------------------ golden


def test_markdown_golden_two_files(tmp_path):
    a = _single_run(tmp_path, "run-a", 1.0, provenance(sha="abc1234def"))
    b = _single_run(
        tmp_path, "run-b", 1.1, provenance(sha="0123456789", dirty=True, driver="575.51.03", torch="2.12.0"), hash_="w1"
    )
    report = cmp.compare(a, b)
    md = cmp.to_markdown(report, images=[("decode delta", "plots/decode_delta.png")])
    _golden("compare_two_files.md", md)
    assert "GPU: NVIDIA H200 (driver 570.86.15) → NVIDIA H200 (driver 575.51.03)" in md
    assert "within-run only" in md and "| TPOT p50 (ms) |" in md


def test_markdown_golden_interleaved(tmp_path):
    report = cmp.compare(_interleaved_run(tmp_path))
    md = cmp.to_markdown(report)
    _golden("compare_interleaved.md", md)
    assert "paired t-interval over 3 interleaved repeats per arm" in md
    c = report.comparisons[0]
    assert (c.a.arm, c.b.arm) == ("triton", "dense")
    assert all(r.method == "paired-t" for r in c.rows)
    assert c.row("tpot_ms.p50").verdict == "worse"
    assert c.row("output_tok_s").verdict == "worse"
    assert c.row("memory.decode.peak_allocated_bytes").delta_pct == pytest.approx(8.0, abs=0.01)


# -------------------------------------------------------------------------------------- verdicts/alignment


def test_shift_detected_and_directions(tmp_path):
    report = cmp.compare(ab_run(tmp_path / "r", repeats=1, n=200, shift=-0.10, seed=1))
    c = report.comparisons[0]
    assert c.row("tpot_ms.p50").verdict == "better"  # latency down = better
    assert c.row("tpot_ms.mean").within_run_only
    assert c.row("itl_ms.p50").method == "cluster-bootstrap"
    assert c.row("output_tok_s").verdict == "n/a"  # one run per arm: no CI for a per-run scalar
    pu = cmp.compare(tmp_path / "r" / "result.json", metrics=["per_user_tok_s.p50"]).comparisons[0].rows
    assert [(r.metric, r.unit, r.verdict) for r in pu] == [("per_user_tok_s.p50", "tok/s", "better")]
    report = cmp.compare(ab_run(tmp_path / "r5", repeats=5, n=100, shift=-0.10, seed=2))
    c = report.comparisons[0]
    assert c.row("tpot_ms.p50").verdict == "better"
    assert c.row("output_tok_s").verdict == "better"  # throughput up = better
    assert c.row("memory.decode.peak_allocated_bytes").verdict == "better"


def test_profiler_rows_compare_kernels_and_idle_gaps(tmp_path):
    """Scenarios with a torch profiler window (runtime.profile, kernel_summary's keys) get profile.* rows, all
    lower-is-better: B with fewer kernels and less launch-gap time per step is better on those rows; a result
    without the window (or one written before idle_gaps) has no such rows."""
    scen, reqs = [], []
    for rep in range(3):
        for arm, kernels, launch in (("triton", 563.0, 0.60), ("dense", 480.0, 0.45)):
            r = requests_for(
                "decode", arm, rep, _fixed(30, 40.0, 1.0, 13), _fixed(30, 8.0, 0.05, 9), t0_ns=rep * 10**10
            )
            reqs += r
            sc = scenario_from_requests("decode", arm, rep, r)
            sc.runtime["profile"] = {
                "kernels": int(kernels * 10), "kernels_per_step": kernels + rep, "device_busy_ms_per_step": 3.67,
                "idle_ms_per_step": launch + 0.07 + 0.001 * rep,
                "idle_gaps": {"launch_gap_ms_per_step": launch + 0.001 * rep, "host_gap_ms_per_step": 0.07},
            }  # fmt: skip
            scen.append(sc)
    c = cmp.compare(write_run(tmp_path / "ab", scen, reqs, prov=provenance())).comparisons[0]
    rows = {r.metric: r for r in c.rows if r.metric.startswith("profile.")}
    assert list(rows) == [
        "profile.kernels_per_step",
        "profile.device_busy_ms_per_step",
        "profile.idle_ms_per_step",
        "profile.launch_gap_ms_per_step",
        "profile.host_gap_ms_per_step",
    ]
    assert rows["profile.kernels_per_step"].unit == "kernels" and rows["profile.kernels_per_step"].verdict == "better"
    assert rows["profile.launch_gap_ms_per_step"].verdict == "better"
    assert rows["profile.host_gap_ms_per_step"].verdict == "no significant change"
    for sc in scen:
        del sc.runtime["profile"]["idle_gaps"]
    assert cmp.available_metrics(scen[0])[-3:] == [f"profile.{f}" for f in cmp.PROFILE_FIELDS]
    plain = cmp.compare(ab_run(tmp_path / "plain", repeats=1, n=30)).comparisons[0]
    assert not [r for r in plain.rows if r.metric.startswith("profile.")]


def test_aa_runs_rarely_flag_anything(tmp_path):
    """End-to-end A/A through files: 20 interleaved runs of 5 repeats; rows are correlated (all throughputs
    derive from one duration), so count the rate over (run, row) pairs."""
    flagged, total = 0, 0
    for seed in range(20):
        rows = cmp.compare(ab_run(tmp_path / f"aa{seed}", repeats=5, n=50, shift=0.0, seed=seed)).comparisons[0].rows
        rows = [r for r in rows if not r.metric.startswith(("memory.", "nvtx."))]  # identical by construction
        flagged += sum(r.verdict in ("better", "worse") for r in rows)
        total += len(rows)
    assert flagged / total <= 0.08, flagged / total


def test_metrics_selection_and_unknown_metric(tmp_path):
    p = ab_run(tmp_path / "r", repeats=1, n=30)
    rows = cmp.compare(p, metrics=["tpot_ms", "output_tok_s", "ttft_ms.p9*"]).comparisons[0].rows
    assert [r.metric for r in rows] == [
        "ttft_ms.p90",
        "ttft_ms.p95",
        "ttft_ms.p99",
        "tpot_ms.mean",
        "tpot_ms.p50",
        "tpot_ms.p90",
        "tpot_ms.p95",
        "tpot_ms.p99",
        "output_tok_s",
    ]
    with pytest.raises(PerfkitError, match="unknown metric"):
        cmp.validate_metric("tpot.p50")


def test_single_arm_file_needs_a_second_file(tmp_path):
    p = _single_run(tmp_path, "one", 1.0, provenance())
    with pytest.raises(PerfkitError, match="one arm"):
        cmp.compare(p)
    with pytest.raises(PerfkitError, match="not found"):
        cmp.compare(tmp_path / "missing.json", p)


def test_failed_repeats_are_left_out_with_a_warning(tmp_path):
    r = requests_for("decode", "a", 0, _fixed(10, 40, 1, 5), _fixed(10, 8, 0.1, 5))
    rb = requests_for("decode", "b", 0, _fixed(10, 44, 1, 5), _fixed(10, 9, 0.1, 5))
    scen = [
        scenario_from_requests("decode", "a", 0, r),
        scenario_from_requests("decode", "b", 0, rb),
        scenario_from_requests("decode", "b", 1, rb, status="oom"),
    ]
    report = cmp.compare(write_run(tmp_path / "x", scen, r + rb))
    assert any("repeat 1 is oom" in w for w in report.warnings)


def test_jit_compiles_in_a_measured_window_are_a_warning(tmp_path):
    """A side whose measured window compiled Triton kernels (runtime.jit_compiles, since 12-01h) is flagged with its
    repeats, counts and seconds; results without the field (older files) are not."""
    r = requests_for("decode", "a", 0, _fixed(10, 40, 1, 5), _fixed(10, 8, 0.1, 5))
    rb = requests_for("decode", "b", 0, _fixed(10, 44, 1, 5), _fixed(10, 9, 0.1, 5))
    sa = scenario_from_requests("decode", "a", 0, r)
    sb = scenario_from_requests("decode", "b", 0, rb)
    assert not any("compiled Triton" in w for w in cmp.compare(write_run(tmp_path / "x", [sa, sb], r + rb)).warnings)
    sb.runtime["jit_compiles"] = {"compiles": 4, "seconds": 2.67}
    sa.runtime["jit_compiles"] = {"compiles": 0, "seconds": 0}
    w = cmp.compare(write_run(tmp_path / "y", [sa, sb], r + rb)).warnings
    assert [x for x in w if "compiled Triton" in x] == [
        "decode: b compiled Triton kernels inside its measured window (repeat 0: 4 in 2.67 s): its times include the "
        "compiles"
    ]


def test_a_different_decode_gemv_choice_is_a_warning(tmp_path):
    """decode_gemv=auto times cuBLAS and the gemv tiles per weight shape when the engine starts (runtime.decode_gemv,
    since 12-05): sides whose timed choices differ are flagged shape by shape; the toggle's own A/B (auto against
    cublas) and results without the field are not."""
    r = requests_for("decode", "a", 0, _fixed(10, 40, 1, 5), _fixed(10, 8, 0.1, 5))
    rb = requests_for("decode", "b", 0, _fixed(10, 44, 1, 5), _fixed(10, 9, 0.1, 5))
    sa = scenario_from_requests("decode", "a", 0, r)
    sb = scenario_from_requests("decode", "b", 0, rb)
    assert not any("decode_gemv" in w for w in cmp.compare(write_run(tmp_path / "x", [sa, sb], r + rb)).warnings)
    row = {"cublas_us": 56.77, "best": "16x512w4e", "best_us": 56.4}
    sa.runtime["decode_gemv"] = {"mode": "auto", "shapes": {"5376x21504": row, "128x2816": {"best": "4x512w2"}}}
    sb.runtime["decode_gemv"] = {"mode": "cublas", "shapes": {}}
    assert not any("decode_gemv" in w for w in cmp.compare(write_run(tmp_path / "y", [sa, sb], r + rb)).warnings)
    sb.runtime["decode_gemv"] = {"mode": "auto", "shapes": {"5376x21504": {**row, "best": "cublas"},
                                                          "128x2816": {"best": "4x512w2"}}}  # fmt: skip
    w = cmp.compare(write_run(tmp_path / "z", [sa, sb], r + rb)).warnings
    assert [x for x in w if "decode_gemv" in x] == [
        "decode: decode_gemv=auto timed a different kernel choice per weight shape, a / b: 5376x21504 16x512w4e / "
        "cublas: the deltas include the choice"
    ]


def test_telemetry_rows_and_a_clock_difference_warning(tmp_path):
    """NVML's summary (telemetry.summary) gives rows per scenario: SM clock (higher is better), power and the
    throttled fraction (lower), means by default, maxima on request. Mean SM clocks more than CLOCK_WARN_PCT
    apart are a comparability warning; results without telemetry have neither."""
    from perfkit.results import TelemetrySection

    scen, reqs = [], []
    for rep in range(3):
        for arm, clock, power, thr in (("a", 1760.0, 630.0, 0.2), ("b", 1600.0, 690.0, 1.0)):
            r = requests_for(
                "decode", arm, rep, _fixed(30, 40.0, 1.0, 13), _fixed(30, 8.0, 0.05, 9), t0_ns=rep * 10**10
            )
            reqs += r
            sc = scenario_from_requests("decode", arm, rep, r)
            sc.telemetry = TelemetrySection(available=True, samples=40, summary={
                "sm_clock_mhz": {"mean": clock + rep, "max": 1980.0}, "power_w": {"mean": power - rep, "max": 700.0},
                "throttled": {"mean": thr * (0.1, 0.5, 1.0)[rep], "max": 1.0},
                "temperature_c": {"mean": 60.0, "max": 63.0}})  # fmt: skip
            scen.append(sc)
    report = cmp.compare(write_run(tmp_path / "ab", scen, reqs, prov=provenance()))
    rows = {r.metric: r for r in report.comparisons[0].rows if r.metric.startswith("telemetry.")}
    assert list(rows) == ["telemetry.sm_clock_mhz.mean", "telemetry.power_w.mean"]  # the throttled fraction on request
    assert rows["telemetry.sm_clock_mhz.mean"].unit == "MHz" and rows["telemetry.sm_clock_mhz.mean"].verdict == "worse"
    assert rows["telemetry.power_w.mean"].verdict == "worse"
    picked = cmp.compare(write_run(tmp_path / "pick", scen, reqs), metrics=["telemetry.throttled.mean"])
    (thr_row,) = picked.comparisons[0].rows
    assert thr_row.metric == "telemetry.throttled.mean" and thr_row.unit == "fraction"
    assert cmp.metric_label("telemetry.power_w.max") == ("NVML power max", "W")
    assert "telemetry.sm_clock_mhz.max" in cmp.available_metrics(scen[0])
    assert not [n for n in report.comparisons[0].notes if "NVML" in n]  # context rows: no noise diagnostics
    assert [w for w in report.warnings if "SM clock" in w] == [
        "decode: the mean SM clock differs, a 1761 MHz, b 1601 MHz (NVML): the deltas include the clock difference"
    ]
    for sc in scen[1::2]:
        sc.telemetry.summary["sm_clock_mhz"]["mean"] = 1740.0  # 1.2 % apart: no warning
    assert not [w for w in cmp.compare(write_run(tmp_path / "near", scen, reqs)).warnings if "SM clock" in w]
    plain = cmp.compare(ab_run(tmp_path / "plain", repeats=1, n=30))
    assert not [r for r in plain.comparisons[0].rows if r.metric.startswith("telemetry.")]
    assert not [w for w in plain.warnings if "SM clock" in w]
    with pytest.raises(PerfkitError, match="telemetry"):
        cmp.validate_metric("telemetry.temperature_c.mean")


# ---------------------------------------------------------------------------------------- comparability


def test_comparability_warnings(tmp_path):
    a = _single_run(tmp_path, "a", 1.0, provenance())
    same = _single_run(tmp_path, "same", 1.0, provenance(sha="9999999999"))
    assert cmp.compare(a, same).warnings == []  # another commit alone is the point of an A/B, not a warning
    b = _single_run(
        tmp_path, "b", 1.0, provenance(gpu="NVIDIA B200", driver="580.1", dirty=True, torch="2.12.0"), hash_="w9"
    )
    w = " | ".join(cmp.compare(a, b).warnings)
    for needle in (
        "GPU differs: A NVIDIA H200, B NVIDIA B200",
        "driver differs",
        "torch 2.11.0 → 2.12.0",
        "B ran from a dirty git tree",
        "decode: workload differs",
    ):
        assert needle in w, needle
    cpu = provenance()
    cpu["gpu"] = {"available": False, "reason": "no CUDA GPU"}
    c = _single_run(tmp_path, "c", 1.0, cpu)
    assert any("GPU availability differs" in x for x in cmp.compare(a, c).warnings)
    q = write_run(tmp_path / "q", [], [], cfg=config(quant="nvfp4"))
    qa = cmp.load(q)
    qa.result.scenarios = cmp.load(a).result.scenarios
    rep = cmp.compare_loaded(cmp.load(a), qa)
    assert any("model.quant differs" in x for x in rep.warnings)


def _suite_run(tmp: Path, name: str, quants: tuple[str, str]) -> Path:
    """A two-model suite (31B bf16 and 31B <quants[1]>): scenario results named "31b-0/decode", "31b-1/decode"."""
    models = [{"preset": "31b", "quant": q, "dtype": "bfloat16", "weights": "random"} for q in quants]
    cfg = config() | {"model": {"preset": "tiny", "quant": "bf16"}, "models": models}
    scen, reqs = [], []
    for i in range(2):
        r = requests_for(f"31b-{i}/decode", "default", 0, _fixed(20, 40.0, 1.5, 11), _fixed(20, 8.0 + i, 0.1, 13))
        reqs += r
        scen.append(scenario_from_requests(f"31b-{i}/decode", "default", 0, r, workload_hash="w0"))
    return write_run(tmp / name, scen, reqs, cfg=cfg, run_id=name)


def test_several_model_suites_name_their_models(tmp_path):
    """A suite run with `models:` is described by those models, not by the `model` default it also carries: the
    provenance line lists them, each table names its scenario's model, and a model that differs between the files
    for the same scenario is a comparability warning."""
    a, b = _suite_run(tmp_path, "a", ("bf16", "nvfp4")), _suite_run(tmp_path, "b", ("bf16", "fp8"))
    rep = cmp.compare(a, a)
    assert "model: 31b · quant: bf16, nvfp4" in rep.provenance_line
    md = cmp.to_markdown(rep)
    assert "31b-0/decode (31b bf16)" in md and "31b-1/decode (31b nvfp4)" in md
    assert not any("model." in w for w in rep.warnings)
    rep = cmp.compare(a, b)
    assert "quant: bf16, nvfp4 → bf16, fp8" in rep.provenance_line
    assert "31b-1/decode (31b nvfp4 → 31b fp8)" in cmp.to_markdown(rep)
    assert [w for w in rep.warnings if "model." in w] == ["model.quant differs: A nvfp4, B fp8"]


def test_tolerates_missing_provenance_keys(tmp_path):
    a = _single_run(tmp_path, "a", 1.0, {})
    b = _single_run(tmp_path, "b", 1.0, {"gpu": {"name": "X"}})
    rep = cmp.compare(a, b)
    assert "commit: `?`" in rep.provenance_line


# ---------------------------------------------------------------------------------------------- --fail-if


def test_threshold_parsing_and_semantics():
    t = cmp.parse_threshold("tpot_ms.p50:+5%")
    assert (t.metric, t.pct) == ("tpot_ms.p50", 5.0)
    assert t.crossed(6.0) and not t.crossed(4.9) and not t.crossed(-20.0)
    t = cmp.parse_threshold("output_tok_s:-3%")
    assert t.crossed(-3.5) and not t.crossed(-2.0) and not t.crossed(10.0)
    assert cmp.parse_threshold("output_tok_s:3%").pct == -3.0  # unsigned = the bad direction
    t = cmp.parse_threshold("tpot_ms.p50:-5%")  # demands an improvement of at least 5 %
    assert t.crossed(-4.0) and not t.crossed(-6.0)
    for bad in ("tpot_ms.p50", "tpot_ms.p50:5", "tpot_ms.p50:+x%", ":5%"):
        with pytest.raises(PerfkitError, match="expected METRIC"):
            cmp.parse_threshold(bad)
    with pytest.raises(PerfkitError, match="unknown metric"):
        cmp.parse_threshold("tpot.p50:+5%")


def test_check_thresholds(tmp_path):
    report = cmp.compare(ab_run(tmp_path / "r", repeats=3, n=60, shift=0.10), extra_metrics=["queue_ms.p50"])
    assert cmp.check_thresholds(report, [cmp.parse_threshold("tpot_ms.p50:+20%")]) == []
    fails = cmp.check_thresholds(report, [cmp.parse_threshold("tpot_ms.p50:+5%")])
    assert len(fails) == 1 and "tpot_ms.p50 +" in fails[0]
    with pytest.raises(PerfkitError, match="not in the compared results"):
        cmp.check_thresholds(report, [cmp.parse_threshold("nvtx.nope.host_mean_ms:+5%")])


# ---------------------------------------------------------------------------------------------------- CLI


def _cli():
    from perfkit.cli import app

    return app


def test_cli_compare_exit_codes_and_outputs(tmp_path):
    app = _cli()
    runner = CliRunner()
    p = ab_run(tmp_path / "r", repeats=3, n=60, shift=0.10)
    md = tmp_path / "pr" / "compare.md"
    res = runner.invoke(
        app,
        [
            "compare",
            str(p),
            "--markdown",
            str(md),
            "--plots",
            str(tmp_path / "pr" / "plots"),
            "--fail-if",
            "tpot_ms.p50:+5%",
        ],
    )
    assert res.exit_code == 1, res.output
    assert "FAIL:" in res.output and "tpot_ms.p50" in res.output
    text = md.read_text()
    assert "| TPOT p50 (ms) |" in text and "](plots/" in text
    assert (tmp_path / "pr" / "plots" / "decode_dense_vs_triton_delta.png").is_file()
    res = runner.invoke(app, ["compare", str(p), "--fail-if", "tpot_ms.p50:+50%", "--metrics", "tpot_ms"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["compare", str(p), "--fail-if", "tpot_ms.p50:fast"])
    assert res.exit_code == 2 and "expected METRIC" in res.output
    res = runner.invoke(app, ["compare", str(p), "--fail-if", "tpot.p50:+5%"])
    assert res.exit_code == 2 and "unknown metric" in res.output
    res = runner.invoke(app, ["compare", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "not found" in res.output


def test_cli_plot(tmp_path):
    p = ab_run(tmp_path / "r", repeats=1, n=20)
    res = CliRunner().invoke(_cli(), ["plot", str(p), "--out", str(tmp_path / "figs")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "figs" / "decode_cdf.png").is_file()
