"""perfkit.stats: summaries, t quantiles, CI calibration by vectorised simulation, verdicts, noise diagnostics."""

from __future__ import annotations

import numpy as np
import pytest

from perfkit import stats as st

SIMS = 500  # A/A and shift simulations per statistic (>= 200); all vectorised, ~1 s in total


# ---------------------------------------------------------------------------------------------------- summaries


def test_summarize_matches_numpy_linear_percentiles():
    x = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 10.0])
    s = st.summarize(x)
    assert s.n == 6 and s.min == 1.0 and s.max == 10.0
    assert s.mean == pytest.approx(x.mean())
    assert s.std == pytest.approx(x.std(ddof=1))
    for q, v in ((50, s.p50), (90, s.p90), (95, s.p95), (99, s.p99)):
        assert v == pytest.approx(np.percentile(x, q))
    assert s.p50 == pytest.approx(3.5) and s.p90 == pytest.approx(7.5)


def test_summarize_empty_and_single():
    s = st.summarize([])
    assert s.n == 0 and s.mean is None and s.p99 is None and s.std is None
    one = st.summarize([7.0])
    assert one.n == 1 and one.std == 0.0 and one.p50 == 7.0 and one.p99 == 7.0
    assert st.summarize([1.0, float("nan")]).n == 1


def test_t_ppf_against_tables():
    assert st.t_ppf(0.975, 1) == pytest.approx(12.7062047, abs=1e-6)
    assert st.t_ppf(0.975, 2) == pytest.approx(4.3026527, abs=1e-6)
    assert st.t_ppf(0.975, 4) == pytest.approx(2.7764451, abs=1e-6)
    assert st.t_ppf(0.975, 29) == pytest.approx(2.0452296, abs=1e-6)
    assert st.t_ppf(0.995, 9) == pytest.approx(3.2498355, abs=1e-6)
    assert st.t_ppf(0.025, 4) == pytest.approx(-2.7764451, abs=1e-6)
    assert st.t_ppf(0.975, 1e9) == pytest.approx(1.959964, abs=1e-6)


# ----------------------------------------------------------------------------------- per-request bootstrap


def _lognormal(rng: np.random.Generator, shape: tuple[int, ...], sigma: float = 0.2) -> np.ndarray:
    return 10.0 * rng.lognormal(0.0, sigma, shape)  # latency-like: right-skewed, CV ~ sigma


@pytest.mark.parametrize("stat", ["mean", "p50", "p90"])
def test_bootstrap_aa_false_positive_rate(stat):
    rng = np.random.default_rng(1234)
    a, b = _lognormal(rng, (SIMS, 200)), _lognormal(rng, (SIMS, 200))
    _, lo, hi = st.bootstrap_delta_pct(a, b, stat, n_resamples=2000, seed=7)
    fpr = float(((lo > 0) | (hi < 0)).mean())
    print(f"bootstrap A/A {stat}: false-positive rate {fpr:.3f} over {SIMS} pairs")
    assert fpr <= 0.07


@pytest.mark.parametrize("stat", ["mean", "p50"])
def test_bootstrap_detects_10pct_shift(stat):
    rng = np.random.default_rng(99)
    a, b = _lognormal(rng, (SIMS, 200)), 1.10 * _lognormal(rng, (SIMS, 200))
    pt, lo, hi = st.bootstrap_delta_pct(a, b, stat, n_resamples=2000, seed=3)
    detected = float((lo > 0).mean())
    print(f"bootstrap 10% shift {stat}: detected in {detected:.3f} of {SIMS}")
    assert detected >= 0.95
    assert np.median(pt) == pytest.approx(10.0, abs=1.5)
    assert (lo <= pt).all() and (pt <= hi).all()


def test_bootstrap_scalar_is_seeded_and_reproducible():
    rng = np.random.default_rng(0)
    a, b = _lognormal(rng, (120,)), _lognormal(rng, (150,))
    r1 = st.bootstrap_delta_pct(a, b, "p90", seed=5)
    r2 = st.bootstrap_delta_pct(a, b, "p90", seed=5)
    r3 = st.bootstrap_delta_pct(a, b, "p90", seed=6)
    assert [float(x) for x in r1] == [float(x) for x in r2]
    assert float(r1[1]) != float(r3[1])
    assert float(r1[0]) == pytest.approx(100 * (np.percentile(b, 90) / np.percentile(a, 90) - 1))


def test_resampled_stat_equals_explicit_resamples():
    """The counts / order-statistic shortcuts equal materialising every resample of sorted data."""
    rng = np.random.default_rng(1)
    x = np.sort(rng.normal(size=(3, 57)), axis=-1)
    for name in ("mean", "p50", "p90", "p99", "min", "max"):
        got = st._resampled_stat(x, name, 40, np.random.default_rng(5))
        idx = np.random.default_rng(5).integers(0, 57, size=(40, 57))
        np.testing.assert_allclose(got, st.statistic(x[..., idx], name))


def test_cluster_bootstrap_weighted_percentiles_match_expanded_sample():
    rng = np.random.default_rng(2)
    groups = [rng.exponential(1.0, size=rng.integers(1, 20)) for _ in range(30)]
    vals = np.concatenate(groups)
    gid = np.repeat(np.arange(30), [len(g) for g in groups])
    order = np.argsort(vals)
    w = rng.integers(0, 3, size=(6, 30)).astype(float)
    w[:, 0] = 1  # never an empty resample
    for name in ("mean", "p50", "p90", "p99"):
        got = st._weighted_stat(vals[order], w[:, gid[order]], name)
        want = [st.statistic(np.concatenate([np.tile(groups[i], int(row[i])) for i in range(30)]), name) for row in w]
        np.testing.assert_allclose(got, want)


def test_cluster_bootstrap_is_wider_than_iid_for_correlated_gaps():
    """Gaps inside one request share a level: resampling requests must give a wider interval than pooling."""
    rng = np.random.default_rng(3)

    def arm(n_req: int) -> list[np.ndarray]:
        return [rng.lognormal(0, 0.3) * 10 * rng.lognormal(0, 0.02, 50) for _ in range(n_req)]

    a, b = arm(40), arm(40)
    pt, lo, hi = st.cluster_bootstrap_delta_pct(a, b, "p50", seed=1)
    _, lo_iid, hi_iid = st.bootstrap_delta_pct(np.concatenate(a), np.concatenate(b), "p50", seed=1)
    assert lo <= pt <= hi
    assert (hi - lo) > 2 * (float(hi_iid) - float(lo_iid))


# ------------------------------------------------------------------------------------------ across repeats


def _repeats(rng: np.random.Generator, sims: int, k: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-repeat statistics of interleaved runs: a drift shared by the A/B pair of each repeat (clocks,
    thermals) much larger than the per-arm noise, which pairing cancels."""
    drift = rng.normal(0.0, 0.08, (sims, k))
    a = 100.0 * np.exp(drift + rng.normal(0.0, 0.02, (sims, k)))
    b = 100.0 * (1 + shift) * np.exp(drift + rng.normal(0.0, 0.02, (sims, k)))
    return a, b


@pytest.mark.parametrize("k", [3, 5, 10])
def test_paired_t_aa_false_positive_rate(k):
    rng = np.random.default_rng(42 + k)
    a, b = _repeats(rng, 4 * SIMS, k, 0.0)
    _, lo, hi = st.paired_delta_pct(a, b)
    fpr = float(((lo > 0) | (hi < 0)).mean())
    print(f"paired-t A/A k={k}: false-positive rate {fpr:.3f} over {4 * SIMS} pairs")
    assert fpr <= 0.07


def test_paired_t_detects_10pct_shift_despite_drift_and_beats_welch():
    rng = np.random.default_rng(7)
    a, b = _repeats(rng, SIMS, 5, 0.10)
    _, lo, hi = st.paired_delta_pct(a, b)
    detected = float((lo > 0).mean())
    _, wlo, whi = st.welch_delta_pct(a, b)
    print(f"paired-t 10% shift k=5: detected {detected:.3f}; Welch (ignores pairing) {float((wlo > 0).mean()):.3f}")
    assert detected >= 0.95
    assert np.median(hi - lo) < 0.5 * np.median(whi - wlo)


def test_welch_aa_false_positive_rate():
    rng = np.random.default_rng(11)
    a = 100 * np.exp(rng.normal(0, 0.05, (4 * SIMS, 5)))
    b = 100 * np.exp(rng.normal(0, 0.05, (4 * SIMS, 4)))
    _, lo, hi = st.welch_delta_pct(a, b)
    assert float(((lo > 0) | (hi < 0)).mean()) <= 0.07


def test_compare_values_method_choice():
    d = st.compare_values([10, 11, 10.5], [12, 12.5, 12.2], "p50", paired=True, per_repeat=True)
    assert d.method == "paired-t" and not d.within_run_only and d.has_ci
    assert d.delta_pct == pytest.approx(100 * (12.2333 / 10.5 - 1), abs=1e-3)
    d = st.compare_values([10, 11, 10.5], [12, 12.5, 12.2, 12.1], "p50", paired=False, per_repeat=True)
    assert d.method == "welch-t"
    d = st.compare_values([10, 11], [12, 12.5], "p50", paired=True, per_repeat=True)
    assert d.method == "none" and not d.has_ci
    d = st.compare_values(np.arange(1, 50.0), np.arange(2, 51.0), "p50", paired=False, per_repeat=False)
    assert d.method == "bootstrap" and d.within_run_only and d.a == 25.0 and d.b == 26.0


# ------------------------------------------------------------------------------------- direction and verdict


def test_direction_per_metric():
    for m in (
        "ttft_ms.p50",
        "tpot_ms.mean",
        "itl_ms.p99",
        "e2el_ms.p90",
        "memory.decode.peak_allocated_bytes",
        "nvtx.forward.host_mean_ms",
    ):
        assert st.direction(m) == "lower", m
    for m in ("output_tok_s", "total_tok_s", "request_s", "goodput_request_s", "per_user_tok_s"):
        assert st.direction(m) == "higher", m
    with pytest.raises(ValueError):
        st.direction("mystery")


def test_verdict_is_direction_aware():
    assert st.verdict(2.0, 8.0, "lower") == "worse"
    assert st.verdict(2.0, 8.0, "higher") == "better"
    assert st.verdict(-8.0, -2.0, "lower") == "better"
    assert st.verdict(-8.0, -2.0, "higher") == "worse"
    assert st.verdict(-1.0, 3.0, "lower") == "no significant change"
    # a zero-width CI a hair away from 0 (identical peak bytes but a few) is no change
    assert st.verdict(1e-6, 1e-6, "lower") == "no significant change"
    assert st.verdict(None, None, "lower") == "n/a"
    v = st.verdicts(np.array([1.0, -5.0, -1.0]), np.array([3.0, -1.0, 1.0]), "higher")
    assert list(v) == ["better", "worse", "no significant change"]


# -------------------------------------------------------------------------------------------------- noise


def test_noise_diagnostics():
    assert st.cv([10, 10, 10]) == 0.0
    assert st.cv([5]) is None
    assert st.cv([9, 10, 11]) == pytest.approx(0.1)
    mask = st.mad_outliers([10.0, 10.1, 9.9, 10.05, 9.95, 10.02, 14.0])
    assert list(np.flatnonzero(mask)) == [6]
    assert not st.mad_outliers([10, 10.1, 14.0]).any()  # too few values to judge
    assert not st.mad_outliers([10.0, 10.1, 9.9, 10.05, 10.3], min_rel=0.05).any()
    assert st.slow_first([13.0, 10.0, 10.2, 9.9], "lower")
    assert not st.slow_first([10.0, 13.0, 10.2, 9.9], "lower")
    assert st.slow_first([700.0, 1000.0, 1010.0], "higher")
    diags = {
        "TPOT p50": st.noise([13.0, 10.0, 10.2, 9.9, 10.1, 10.0], "lower"),
        "TTFT p50": st.noise([50.0, 70.0, 50.0, 51.0, 30.0, 60.0], "lower"),
    }
    lines = st.noise_warnings("dense", diags)
    assert any("first repeat" in x and "TPOT p50" in x for x in lines)
    assert any("CV" in x and "TTFT p50" in x for x in lines)
    assert any("repeat 0 is an outlier" in x for x in lines)
