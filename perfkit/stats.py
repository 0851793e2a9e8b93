"""Summaries, confidence intervals on A/B deltas, verdicts and noise diagnostics.

Everything works on numpy arrays whose *last* axis holds the samples, so the same code serves one comparison
(1-D inputs) and a vectorised simulation of thousands of comparisons (leading batch axes).

Deltas are relative: ``delta % = 100 * (B - A) / A`` where A and B are the same statistic (mean, p50, ...) of
the two arms. Two ways to put a confidence interval on it:

* **Across repeats** (>= 3 repeats per arm, the trustworthy one). Each repeat gives one number per arm (its
  p50, its throughput, ...). Interleaved repeats (A B A B) are *paired* by repeat index and we take a Student-t
  interval on the paired differences ``d_r = B_r - A_r``, divided by mean(A). Why t and not a bootstrap:
  with the 3-10 repeats a benchmark can afford, a bootstrap over k paired differences has only a handful of
  distinct resamples (10 for k = 3) and its percentile interval is far too narrow (coverage ~80 % at k = 5);
  the t-interval is exact for normal differences and per-repeat summaries of hundreds of requests are close to
  normal (CLT). Pairing cancels drift shared by adjacent repeats (clocks, thermals, other tenants). Repeats of
  two separate result files are not interleaved, so they get Welch's unpaired t-interval instead.
  Dividing by mean(A) treats the denominator as known; its own error only scales the interval by
  ``1 +- CV(A)/sqrt(k)``, second order next to the spread of the differences.
* **Within one run** (fewer repeats). A percentile bootstrap over per-request values: resample each arm's
  requests independently (2,000 resamples, seeded numpy Generator, vectorised in chunks), recompute the
  statistic and the delta, take the 2.5/97.5 % quantiles. This only sees request-to-request noise, not
  run-to-run noise, so it is flagged "within-run only": a real but small shift and a run-level fluke look
  the same to it. Pooled metrics whose samples are not independent (ITL: many gaps per request) resample
  whole requests (a cluster bootstrap), with the pooled percentile computed from resample weights.

Verdicts are direction-aware: a CI entirely below zero is *better* for latencies and memory and *worse* for
throughputs.
"""

from __future__ import annotations

import math
import statistics as _pystats
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from perfkit.results import Stats

Direction = Literal["lower", "higher"]
Verdict = Literal["better", "worse", "no significant change", "n/a"]

STAT_NAMES = ("mean", "p50", "p90", "p95", "p99")
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
DEFAULT_RESAMPLES = 2000
_CHUNK_ELEMENTS = 4_000_000  # resample matrix elements per chunk: bounds memory at ~32 MB of float64

# noise thresholds
CV_WARN = 0.10  # AIPerf's bands: < 5 % excellent, 5-10 % good, above that noisy
OUTLIER_Z = 3.5  # modified z-score (Iglewicz & Hoaglin) above which a value is an outlier
OUTLIER_MIN_REL = 0.05  # ... and more than 5 % away from the median (tiny MADs of 3-5 tight repeats)
SLOW_FIRST_REL = 0.05  # first repeat worse than every other one and than their median by more than 5 %


# --------------------------------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------------------------------


def summarize(values: Sequence[float] | np.ndarray) -> Stats:
    """n, mean, sample std (ddof=1; 0 for one value), min, p50/p90/p95/p99 (linear interpolation), max."""
    x = np.asarray(values, dtype=float).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Stats(n=0)
    p50, p90, p95, p99 = np.percentile(x, [50, 90, 95, 99])
    return Stats(
        n=int(x.size),
        mean=float(x.mean()),
        std=float(x.std(ddof=1)) if x.size > 1 else 0.0,
        min=float(x.min()),
        p50=float(p50),
        p90=float(p90),
        p95=float(p95),
        p99=float(p99),
        max=float(x.max()),
    )


def statistic(x: np.ndarray, name: str) -> np.ndarray:
    """The named statistic along the last axis: mean, p50, p90, p95, p99 (linear), min, max, std."""
    if name == "mean":
        return x.mean(axis=-1)
    if name in PERCENTILES:
        return np.percentile(x, PERCENTILES[name], axis=-1)
    if name == "min":
        return x.min(axis=-1)
    if name == "max":
        return x.max(axis=-1)
    if name == "std":
        return x.std(axis=-1, ddof=1)
    raise ValueError(f"unknown statistic {name!r}; allowed: {', '.join(STAT_NAMES)}, min, max, std")


# --------------------------------------------------------------------------------------------------------------
# Student t quantile (no scipy dependency)
# --------------------------------------------------------------------------------------------------------------


def _t_pdf(x: np.ndarray | float, df: float) -> np.ndarray | float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return np.exp(c - (df + 1) / 2 * np.log1p(np.asarray(x) ** 2 / df))


def _t_cdf_pos(x: float, df: float) -> float:
    """P(T <= x) for x >= 0 by Simpson integration of the density over [0, x] (error << 1e-9 here)."""
    grid = np.linspace(0.0, x, 2001)
    f = _t_pdf(grid, df)
    h = grid[1] - grid[0]
    return 0.5 + float(h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))


def t_ppf(q: float, df: float) -> float:
    """Quantile of Student's t with `df` degrees of freedom (Newton from the normal quantile)."""
    if not 0.0 < q < 1.0:
        raise ValueError("q must lie in (0, 1)")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    z = _pystats.NormalDist().inv_cdf(q)
    if q == 0.5 or df > 1e7:
        return z
    x = z  # the t quantile is larger; F is concave on x > 0, so Newton climbs monotonically from below
    for _ in range(200):
        step = (q - _t_cdf_pos(x, df)) / float(_t_pdf(x, df))
        x += step
        if abs(step) < 1e-10 * max(1.0, x):
            break
    return x


# --------------------------------------------------------------------------------------------------------------
# deltas and confidence intervals
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaCI:
    """A relative delta of B against A with its confidence interval (all in percent)."""

    a: float
    b: float
    delta_pct: float
    lo_pct: float | None
    hi_pct: float | None
    method: str  # "paired-t" | "welch-t" | "bootstrap" | "none"
    n_a: int
    n_b: int
    within_run_only: bool = False
    confidence: float = 0.95

    @property
    def has_ci(self) -> bool:
        return self.lo_pct is not None and self.hi_pct is not None


def _pct(delta: np.ndarray, base: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100.0 * delta / base


def paired_delta_pct(a: np.ndarray, b: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, ...]:
    """Paired t-interval on B_r - A_r over repeats (last axis), as percent of mean(A). Returns (pt, lo, hi)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError("paired repeats need the same number of repeats per arm")
    k = a.shape[-1]
    if k < 2:
        raise ValueError("a paired interval needs at least 2 repeats per arm")
    d = b - a
    base = a.mean(axis=-1)
    mean_d = d.mean(axis=-1)
    half = t_ppf(0.5 + confidence / 2, k - 1) * d.std(axis=-1, ddof=1) / math.sqrt(k)
    return _pct(mean_d, base), _pct(mean_d - half, base), _pct(mean_d + half, base)


def welch_delta_pct(a: np.ndarray, b: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, ...]:
    """Welch's unpaired t-interval on mean(B) - mean(A) over repeats (last axis), as percent of mean(A)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    ka, kb = a.shape[-1], b.shape[-1]
    if ka < 2 or kb < 2:
        raise ValueError("an unpaired interval needs at least 2 repeats per arm")
    va = a.var(axis=-1, ddof=1) / ka
    vb = b.var(axis=-1, ddof=1) / kb
    se = np.sqrt(va + vb)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = (va + vb) ** 2 / (va**2 / (ka - 1) + vb**2 / (kb - 1))
    df = np.where(np.isfinite(df) & (df > 0), df, ka + kb - 2)
    tq = np.vectorize(lambda v: t_ppf(0.5 + confidence / 2, float(v)))(df)
    base = a.mean(axis=-1)
    diff = b.mean(axis=-1) - base
    return _pct(diff, base), _pct(diff - tq * se, base), _pct(diff + tq * se, base)


def _resampled_stat(x: np.ndarray, name: str, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Statistic of `n_resamples` bootstrap resamples of the last axis of x: shape (..., n_resamples).

    One index matrix serves every batch row, and no resample is materialised: the mean is a matrix product with
    the resample counts; an order statistic of a resample of sorted data is the data at the resample's sorted
    indices, so percentiles need only the two neighbouring order statistics of each index row."""
    n = x.shape[-1]
    chunk = max(1, _CHUNK_ELEMENTS // n)
    xs = np.sort(x, axis=-1) if name != "mean" else x
    out = []
    for start in range(0, n_resamples, chunk):
        r = min(chunk, n_resamples - start)
        idx = rng.integers(0, n, size=(r, n))
        if name == "mean":
            counts = np.bincount((idx + (np.arange(r) * n)[:, None]).ravel(), minlength=r * n).reshape(r, n)
            out.append(x @ counts.T.astype(float) / n)
        elif name in PERCENTILES or name in ("min", "max"):
            h = {"min": 0.0, "max": 100.0}.get(name, PERCENTILES.get(name, 0.0)) / 100.0 * (n - 1)
            lo = int(math.floor(h))
            hi = min(lo + 1, n - 1)
            sidx = np.partition(idx, sorted({lo, hi}), axis=1)
            v_lo = xs[..., sidx[:, lo]]
            out.append(v_lo + (h - lo) * (xs[..., sidx[:, hi]] - v_lo))
        else:
            out.append(statistic(x[..., idx], name))
    return np.concatenate(out, axis=-1)


def bootstrap_delta_pct(
    a: np.ndarray,
    b: np.ndarray,
    stat: str = "mean",
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[np.ndarray, ...]:
    """Percentile-bootstrap CI on 100 * (stat(B) - stat(A)) / stat(A), arms resampled independently.

    a, b: samples on the last axis (leading axes are a batch). Returns (point, lo, hi)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.shape[-1] < 2 or b.shape[-1] < 2:
        raise ValueError("a bootstrap needs at least 2 samples per arm")
    rng = np.random.default_rng(seed)
    sa, sb = statistic(a, stat), statistic(b, stat)
    ra = _resampled_stat(a, stat, n_resamples, rng)
    rb = _resampled_stat(b, stat, n_resamples, rng)
    deltas = _pct(rb - ra, ra)
    alpha = (1 - confidence) / 2
    lo, hi = np.nanquantile(deltas, [alpha, 1 - alpha], axis=-1)
    return _pct(sb - sa, sa), lo, hi


def _weighted_stat(sorted_vals: np.ndarray, weights: np.ndarray, name: str) -> np.ndarray:
    """Statistic of each row's weighted sample (integer weights = repeat counts), matching np.percentile's
    linear interpolation on the expanded sample. sorted_vals: (G,) ascending; weights: (r, G)."""
    total = weights.sum(axis=1)
    if name == "mean":
        return weights @ sorted_vals / total
    if name not in PERCENTILES:
        raise ValueError(f"cluster bootstrap supports mean and {', '.join(PERCENTILES)}, not {name!r}")
    cw = np.cumsum(weights, axis=1)
    h = PERCENTILES[name] / 100.0 * (total - 1)
    lo = np.floor(h)
    frac = h - lo
    r, g = weights.shape
    offset = (np.arange(r) * (cw[:, -1].max() + 1))[:, None]
    flat = (cw + offset).ravel()

    def value_at(j: np.ndarray) -> np.ndarray:  # j-th (0-based) element of each row's expanded sorted sample
        pos = np.searchsorted(flat, j + offset[:, 0], side="right") - np.arange(r) * g
        return sorted_vals[np.clip(pos, 0, g - 1)]

    v_lo = value_at(lo)
    v_hi = value_at(np.minimum(lo + 1, total - 1))
    return v_lo + frac * (v_hi - v_lo)


def _cluster_resampled(groups: list[np.ndarray], name: str, n_resamples: int, rng: np.random.Generator):
    vals = np.concatenate(groups)
    gid = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    order = np.argsort(vals, kind="stable")
    sv, sg = vals[order], gid[order]
    n = len(groups)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, vals.size))
    out = []
    for start in range(0, n_resamples, chunk):
        r = min(chunk, n_resamples - start)
        idx = rng.integers(0, n, size=(r, n)) + (np.arange(r) * n)[:, None]
        counts = np.bincount(idx.ravel(), minlength=r * n).reshape(r, n)
        out.append(_weighted_stat(sv, counts[:, sg].astype(float), name))
    return np.concatenate(out)


def cluster_bootstrap_delta_pct(
    a_groups: list[np.ndarray],
    b_groups: list[np.ndarray],
    stat: str = "mean",
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """Bootstrap CI for a pooled statistic (e.g. ITL: gaps of many requests) resampling whole groups
    (requests), so correlated samples inside one request are not mistaken for independent evidence."""
    a_groups = [np.asarray(g, dtype=float) for g in a_groups if len(g)]
    b_groups = [np.asarray(g, dtype=float) for g in b_groups if len(g)]
    if len(a_groups) < 2 or len(b_groups) < 2:
        raise ValueError("a cluster bootstrap needs at least 2 non-empty groups per arm")
    rng = np.random.default_rng(seed)
    sa = float(statistic(np.concatenate(a_groups), stat))
    sb = float(statistic(np.concatenate(b_groups), stat))
    ra = _cluster_resampled(a_groups, stat, n_resamples, rng)
    rb = _cluster_resampled(b_groups, stat, n_resamples, rng)
    deltas = _pct(rb - ra, ra)
    alpha = (1 - confidence) / 2
    lo, hi = np.nanquantile(deltas, [alpha, 1 - alpha])
    return float(_pct(np.float64(sb - sa), np.float64(sa))), float(lo), float(hi)


# --------------------------------------------------------------------------------------------------------------
# direction and verdict
# --------------------------------------------------------------------------------------------------------------


def direction(metric: str) -> Direction:
    """Which way is good for a metric path: latencies (`_ms`) and memory (`_bytes`) lower, throughputs higher."""
    leaf = metric.lower()
    parts = leaf.split(".")
    if any(
        p.endswith("_tok_s") or p in ("request_s", "goodput_request_s", "goodput_fraction", "mbu", "mfu") for p in parts
    ):
        return "higher"
    if any(p.endswith("_ms") or p.endswith("_bytes") or p.endswith("_gib") for p in parts):
        return "lower"
    raise ValueError(f"no known direction for metric {metric!r} (expected a *_ms, *_bytes or *_tok_s metric)")


# A change is reported only when its CI excludes +-MIN_EFFECT_PCT, not merely 0: a deterministic quantity
# (peak bytes, an identical plan) that differs by a few bytes has a zero-width CI next to 0 and is no change.
MIN_EFFECT_PCT = 0.1


def verdict(lo_pct: float | None, hi_pct: float | None, dir_: Direction) -> Verdict:
    """better / worse when the CI excludes [-MIN_EFFECT_PCT, +MIN_EFFECT_PCT], else no significant change;
    n/a without a CI."""
    if lo_pct is None or hi_pct is None or not (math.isfinite(lo_pct) and math.isfinite(hi_pct)):
        return "n/a"
    if lo_pct > MIN_EFFECT_PCT:
        return "better" if dir_ == "higher" else "worse"
    if hi_pct < -MIN_EFFECT_PCT:
        return "better" if dir_ == "lower" else "worse"
    return "no significant change"


def verdicts(lo: np.ndarray, hi: np.ndarray, dir_: Direction) -> np.ndarray:
    """Vectorised `verdict`: an array of strings."""
    up = np.where(dir_ == "higher", "better", "worse")
    down = np.where(dir_ == "lower", "better", "worse")
    return np.where(lo > MIN_EFFECT_PCT, up, np.where(hi < -MIN_EFFECT_PCT, down, "no significant change"))


def compare_values(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    stat: str,
    *,
    paired: bool,
    seed: int = 0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    per_repeat: bool,
) -> DeltaCI:
    """One delta with the method the data allows.

    per_repeat=True: a and b are per-repeat values of the statistic (>= 3 each -> paired-t or welch-t).
    per_repeat=False: a and b are per-request samples (bootstrap, within-run only)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    a = a[np.isfinite(a)]
    b = b[np.isfinite(b)]
    if per_repeat:
        va, vb = float(a.mean()), float(b.mean())
        if paired and a.size == b.size and a.size >= 3:
            pt, lo, hi = paired_delta_pct(a, b, confidence)
            method = "paired-t"
        elif a.size >= 3 and b.size >= 3:
            pt, lo, hi = welch_delta_pct(a, b, confidence)
            method = "welch-t"
        else:
            pt, lo, hi, method = 100 * (vb - va) / va if va else math.nan, None, None, "none"
        return DeltaCI(va, vb, float(pt), _f(lo), _f(hi), method, int(a.size), int(b.size), False, confidence)
    va, vb = float(statistic(a, stat)), float(statistic(b, stat))
    if a.size >= 2 and b.size >= 2:
        pt, lo, hi = bootstrap_delta_pct(a, b, stat, n_resamples, seed, confidence)
        return DeltaCI(va, vb, float(pt), _f(lo), _f(hi), "bootstrap", int(a.size), int(b.size), True, confidence)
    pt = 100 * (vb - va) / va if va else math.nan
    return DeltaCI(va, vb, pt, None, None, "none", int(a.size), int(b.size), True, confidence)


def _f(x: object) -> float | None:
    if x is None:
        return None
    v = float(x)  # type: ignore[arg-type]
    return v if math.isfinite(v) else None


# --------------------------------------------------------------------------------------------------------------
# noise diagnostics
# --------------------------------------------------------------------------------------------------------------


def cv(values: Sequence[float] | np.ndarray) -> float | None:
    """Coefficient of variation (sample std / mean); None with fewer than 2 values or a zero mean."""
    x = np.asarray(values, dtype=float)
    if x.size < 2 or x.mean() == 0:
        return None
    return float(x.std(ddof=1) / abs(x.mean()))


def mad_outliers(
    values: Sequence[float] | np.ndarray, threshold: float = OUTLIER_Z, min_rel: float = 0.0
) -> np.ndarray:
    """Boolean mask of outliers by the modified z-score |x - median| / (1.4826 MAD) > threshold.
    Robust to the outliers themselves (unlike mean +- k sigma); all False when MAD is 0 or n < 5. `min_rel` also
    requires |x - median| > min_rel * |median|, so a 0.5 % wobble among very tight repeats is not reported."""
    x = np.asarray(values, dtype=float)
    if x.size < 5:  # the MAD of 3-4 values is too unstable to call anything an outlier
        return np.zeros(x.shape, dtype=bool)
    med = np.median(x)
    mad = 1.4826 * np.median(np.abs(x - med))
    if mad == 0:
        return np.zeros(x.shape, dtype=bool)
    dev = np.abs(x - med)
    return (dev / mad > threshold) & (dev > min_rel * abs(med))


def slow_first(values: Sequence[float] | np.ndarray, dir_: Direction = "lower", rel: float = SLOW_FIRST_REL) -> bool:
    """True when the first repeat is worse than every later one and than their median by more than `rel`
    (hyperfine's "first run was significantly slower": caches, JIT, clocks still ramping)."""
    x = np.asarray(values, dtype=float)
    if x.size < 3:
        return False
    first, rest = x[0], x[1:]
    med = float(np.median(rest))
    if med == 0:
        return False
    if dir_ == "lower":
        return bool(first > rest.max() and (first - med) / abs(med) > rel)
    return bool(first < rest.min() and (med - first) / abs(med) > rel)


@dataclass
class Noise:
    """Noise diagnostics of one arm's per-repeat values of one metric."""

    cv: float | None
    slow_first: bool
    outlier_repeats: list[int]


def noise(per_repeat: Sequence[float], dir_: Direction, repeats: Sequence[int] | None = None) -> Noise:
    x = np.asarray(per_repeat, dtype=float)
    ids = list(range(x.size)) if repeats is None else list(repeats)
    keep = np.isfinite(x)
    x = x[keep]
    ids = [i for i, k in zip(ids, keep, strict=True) if k]
    mask = mad_outliers(x, min_rel=OUTLIER_MIN_REL)
    return Noise(cv(x), slow_first(x, dir_), [ids[i] for i in np.flatnonzero(mask)])


def noise_warnings(arm: str, diags: dict[str, Noise]) -> list[str]:
    """Summarise one arm's diagnostics over metrics (label -> Noise) in at most three lines."""
    out: list[str] = []
    noisy = [f"{m} {100 * d.cv:.1f}%" for m, d in diags.items() if d.cv is not None and d.cv > CV_WARN]
    if noisy:
        out.append(f"{arm}: CV across repeats above {100 * CV_WARN:.0f}%: {', '.join(noisy)}")
    slow = [m for m, d in diags.items() if d.slow_first]
    if slow:
        out.append(f"{arm}: first repeat clearly worse than all later ones on {', '.join(slow)}; add warmup")
    by_rep: dict[int, list[str]] = {}
    for m, d in diags.items():
        for r in d.outlier_repeats:
            by_rep.setdefault(r, []).append(m)
    for r, ms in sorted(by_rep.items()):
        out.append(
            f"{arm}: repeat {r} is an outlier (modified z > {OUTLIER_Z}, > {100 * OUTLIER_MIN_REL:.0f}% "
            f"off the median) on {', '.join(ms)}"
        )
    return out


def _num(v: float) -> str:
    return f"{v:.4g}"
