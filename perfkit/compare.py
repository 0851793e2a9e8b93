"""A/B comparison of results: align, compute deltas with CIs and verdicts, render a rich table or Markdown.

Two ways to call it:

* ``compare(A.json, B.json)``: scenarios matched by name (and arm, when both files ran the same arms);
* ``compare(RESULT.json)``: the arms inside one interleaved run; the first arm is A, every other arm is a B.

Each metric row has A, B, delta %, a 95 % CI on the delta and a verdict (see `perfkit.stats` for the methods:
a paired t-interval across >= 3 interleaved repeats, else a per-request bootstrap flagged "within-run only").
`--fail-if tpot_ms.p50:+5%` gates CI: the delta crossing the threshold in the metric's bad direction fails.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perfkit import stats as st
from perfkit.errors import PerfkitError
from perfkit.results import (
    Result,
    ScenarioResult,
    model_text,
    read_requests,
    read_result,
    scenario_model,
    scenario_model_config,
    suite_models,
)

DIST_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms", "per_user_tok_s")
DEFAULT_DIST = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
DEFAULT_STATS = ("p50", "p90", "p99", "mean")
THROUGHPUTS = ("output_tok_s", "total_tok_s", "request_s", "goodput_request_s")
PER_GPU_THROUGHPUTS = ("output_tok_s_per_gpu", "total_tok_s_per_gpu")  # / tensor-parallel world size; higher
MEMORY_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes")
NVTX_FIELDS = tuple(f"{w}_{s}_ms" for w in ("host", "device") for s in ("mean", "p50", "p99", "total"))
# From a torch profiler window (`runtime.profile`, capture.profiler.kernel_summary; the gaps from its idle_gaps):
# where a step's device time goes, so an A/B that fuses kernels shows fewer kernels and less idle time. All lower.
PROFILE_FIELDS = ("kernels_per_step", "device_busy_ms_per_step", "idle_ms_per_step")
PROFILE_GAP_FIELDS = ("launch_gap_ms_per_step", "host_gap_ms_per_step")
# From NVML (`telemetry.summary`): the clock and power an arm ran at, beside its times. A faster arm that draws
# more power may run at a lower clock under the power cap; a slower one may have run throttled. Higher SM clock is
# better; lower power and a lower throttled fraction (of samples with a slowdown reason) are.
TELEMETRY_FIELDS = {"sm_clock_mhz": ("SM clock", "MHz", "higher"), "power_w": ("power", "W", "lower"),
                    "throttled": ("throttled samples", "fraction", "lower")}  # fmt: skip
CLOCK_WARN_PCT = 3.0  # mean SM clocks further apart than this: a comparability warning

_METRIC_RE = re.compile(
    r"^(?:(?P<dist>ttft_ms|tpot_ms|itl_ms|e2el_ms|queue_ms|per_user_tok_s)\.(?P<stat>mean|p50|p90|p95|p99)"
    r"|(?P<tp>output_tok_s_per_gpu|total_tok_s_per_gpu|output_tok_s|total_tok_s|request_s|goodput_request_s)"
    r"|memory\.(?P<phase>[^.]+)\.(?P<mem>peak_allocated_bytes|peak_reserved_bytes)"
    r"|nvtx\.(?P<range>.+)\.(?P<nv>(?:host|device)_(?:mean|p50|p99|total)_ms)"
    r"|profile\.(?P<prof>kernels_per_step|device_busy_ms_per_step|idle_ms_per_step|launch_gap_ms_per_step"
    r"|host_gap_ms_per_step)"
    r"|telemetry\.(?P<tel>sm_clock_mhz|power_w|throttled)\.(?P<tstat>mean|max))$"
)
METRIC_FORMS = (
    "<ttft|tpot|itl|e2el|queue>_ms.<mean|p50|p90|p95|p99>, per_user_tok_s.<stat>, output_tok_s, total_tok_s, request_s, "
    "output_tok_s_per_gpu, total_tok_s_per_gpu, "
    "goodput_request_s, memory.<phase>.<peak_allocated_bytes|peak_reserved_bytes>, "
    "nvtx.<range>.<host|device>_<mean|p50|p99|total>_ms, "
    "profile.<kernels_per_step|device_busy_ms_per_step|idle_ms_per_step|launch_gap_ms_per_step|host_gap_ms_per_step>, "
    "telemetry.<sm_clock_mhz|power_w|throttled>.<mean|max>"
)

DEFINITIONS = (
    "TTFT: first output token on the host − request submitted to the engine. "
    "TPOT: per request (last token − first token) / (output tokens − 1), distribution across requests. "
    "ITL: every gap between consecutive tokens of a request, pooled over requests. "
    "E2EL: last token − submitted. "
    "Throughput: Σ tokens / (last finish − first submit). "
    "(trtllm-bench conventions; percentiles by linear interpolation.)"
)

VERDICT_MARK = {"better": "✅ better", "worse": "❌ worse", "no significant change": "≈ no sig. change", "n/a": "n/a"}


# --------------------------------------------------------------------------------------------------------------
# data model
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    """A result file with its per-request lines."""

    path: Path
    result: Result
    requests: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return self.result.run_id


def load(path: str | Path) -> Loaded:
    p = Path(path)
    result = read_result(p)
    return Loaded(p, result, read_requests(p if p.is_dir() else p.parent))


@dataclass
class Side:
    """One arm of one scenario of one file: its ok repeats and its requests."""

    loaded: Loaded
    scenario: str
    arm: str
    repeats: list[ScenarioResult]
    requests: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return self.arm


@dataclass
class MetricRow:
    metric: str
    label: str
    unit: str
    direction: str
    a: float | None
    b: float | None
    delta_pct: float | None
    lo_pct: float | None
    hi_pct: float | None
    verdict: str
    method: str  # paired-t | welch-t | bootstrap | cluster-bootstrap | none
    n_a: int = 0
    n_b: int = 0

    @property
    def within_run_only(self) -> bool:
        return self.method in ("bootstrap", "cluster-bootstrap")


@dataclass
class Comparison:
    scenario: str
    a: Side
    b: Side
    rows: list[MetricRow]
    notes: list[str] = field(default_factory=list)

    def row(self, metric: str) -> MetricRow | None:
        return next((r for r in self.rows if r.metric == metric), None)


@dataclass
class Report:
    a: Loaded
    b: Loaded
    comparisons: list[Comparison]
    warnings: list[str]
    provenance_line: str
    confidence: float = 0.95


# --------------------------------------------------------------------------------------------------------------
# metric paths
# --------------------------------------------------------------------------------------------------------------


def _direction(path: str) -> st.Direction:
    """st.direction, plus the per-GPU throughputs (higher is better; their names do not end in _tok_s) and the
    profiler's per-step counts and times (lower), and NVML's (TELEMETRY_FIELDS)."""
    if path.startswith("profile."):
        return "lower"
    if path.startswith("telemetry."):
        return TELEMETRY_FIELDS[path.split(".")[1]][2]  # type: ignore[return-value]
    return "higher" if path in PER_GPU_THROUGHPUTS else st.direction(path)


def validate_metric(path: str) -> re.Match[str]:
    m = _METRIC_RE.match(path)
    if m is None:
        raise PerfkitError(f"unknown metric {path!r}; allowed forms: {METRIC_FORMS}")
    return m


def metric_label(path: str) -> tuple[str, str]:
    """(display label, unit) of a metric path."""
    m = validate_metric(path)
    if m["dist"] == "per_user_tok_s":
        return f"per-user {m['stat']}", "tok/s"
    if m["dist"]:
        return f"{m['dist'][:-3].upper()} {m['stat']}", "ms"
    if m["tp"]:
        return {
            "output_tok_s": ("output throughput", "tok/s"),
            "total_tok_s": ("total throughput", "tok/s"),
            "request_s": ("request throughput", "req/s"),
            "goodput_request_s": ("goodput", "req/s"),
            "output_tok_s_per_gpu": ("output throughput / GPU", "tok/s"),
            "total_tok_s_per_gpu": ("total throughput / GPU", "tok/s"),
        }[m["tp"]]
    if m["mem"]:
        kind = "allocated" if "allocated" in m["mem"] else "reserved"
        return f"peak {kind} · {m['phase']}", "GiB"
    if m["prof"]:
        return {
            "kernels_per_step": ("profile: kernels per step", "kernels"),
            "device_busy_ms_per_step": ("profile: device busy per step", "ms"),
            "idle_ms_per_step": ("profile: device idle per step", "ms"),
            "launch_gap_ms_per_step": ("profile: launch gaps per step", "ms"),
            "host_gap_ms_per_step": ("profile: host gaps per step", "ms"),
        }[m["prof"]]
    if m["tel"]:
        what, unit, _ = TELEMETRY_FIELDS[m["tel"]]
        return f"NVML {what} {m['tstat']}", unit
    where, stat = m["nv"][:-3].split("_")
    return f"NVTX {m['range']} {where} {stat}", "ms"


def _repeat_value(s: ScenarioResult, path: str) -> float | None:
    m = validate_metric(path)
    v: Any = None
    if m["dist"]:
        stats = s.metrics.get(m["dist"])
        v = getattr(stats, m["stat"]) if stats is not None else None
    elif m["tp"]:
        v = getattr(s.throughput, m["tp"], None) if s.throughput is not None else None
    elif m["mem"]:
        if s.memory is not None and s.memory.available and m["phase"] in s.memory.phases:
            v = getattr(s.memory.phases[m["phase"]], m["mem"])
    elif m["prof"]:
        prof = s.runtime.get("profile") or {}
        v = (prof.get("idle_gaps") or {}).get(m["prof"]) if m["prof"] in PROFILE_GAP_FIELDS else prof.get(m["prof"])
    elif m["tel"]:
        if s.telemetry is not None and s.telemetry.available:
            v = (s.telemetry.summary.get(m["tel"]) or {}).get(m["tstat"])
    else:
        r = s.nvtx.get(m["range"])
        v = getattr(r, m["nv"]) if r is not None else None
    return float(v) if v is not None and math.isfinite(float(v)) else None


def available_metrics(s: ScenarioResult) -> list[str]:
    """Every metric path this scenario has, in report order."""
    out = [
        f"{d}.{q}"
        for d in DIST_METRICS
        for q in ("mean", "p50", "p90", "p95", "p99")
        if d in s.metrics and s.metrics[d].n > 0
    ]
    if s.throughput is not None:
        out += [t for t in THROUGHPUTS + PER_GPU_THROUGHPUTS if getattr(s.throughput, t, None) is not None]
    if s.memory is not None and s.memory.available:
        out += [f"memory.{ph}.{f}" for ph in s.memory.phases for f in MEMORY_FIELDS]
    for name, r in s.nvtx.items():
        out += [f"nvtx.{name}.{f}" for f in NVTX_FIELDS if getattr(r, f) is not None]
    prof = s.runtime.get("profile") or {}
    if prof.get("kernels"):  # a torch profiler window with device kernels (results before 12-01g: no idle_gaps)
        out += [f"profile.{f}" for f in PROFILE_FIELDS if prof.get(f) is not None]
        out += [f"profile.{f}" for f in PROFILE_GAP_FIELDS if (prof.get("idle_gaps") or {}).get(f) is not None]
    if s.telemetry is not None and s.telemetry.available:
        summary = s.telemetry.summary
        out += [f"telemetry.{f}.{q}" for f in TELEMETRY_FIELDS for q in ("mean", "max") if q in (summary.get(f) or {})]
    return out


def default_metrics(s: ScenarioResult) -> list[str]:
    have = set(available_metrics(s))
    out = [f"{d}.{q}" for d in DEFAULT_DIST for q in DEFAULT_STATS if f"{d}.{q}" in have]
    out += [t for t in THROUGHPUTS if t in have]
    if s.runtime.get("tp", {}).get("tp_world_size", 1) > 1:  # per-GPU rows only where they differ
        out += [t for t in PER_GPU_THROUGHPUTS if t in have]
    out += [p for p in available_metrics(s) if p.startswith("memory.") and p.endswith("peak_allocated_bytes")]
    out += [p for p in available_metrics(s) if p.startswith("nvtx.") and p.endswith(("host_mean_ms", "device_mean_ms"))]
    out += [p for p in available_metrics(s) if p.startswith("profile.")]
    out += [p for p in ("telemetry.sm_clock_mhz.mean", "telemetry.power_w.mean") if p in have]  # not the
    # throttled fraction: a % change of a fraction near 0 is meaningless (0.08 -> 1.0 is +1100 %; --metrics has it)
    return out


def _select(paths: list[str], patterns: Sequence[str] | None) -> list[str]:
    """Filter by `--metrics`: a pattern matches a path exactly, as a dotted prefix, or as a glob."""
    if not patterns:
        return paths
    from fnmatch import fnmatchcase

    return [p for p in paths if any(p == q or p.startswith(q + ".") or fnmatchcase(p, q) for q in patterns)]


# --------------------------------------------------------------------------------------------------------------
# alignment
# --------------------------------------------------------------------------------------------------------------


def _groups(lo: Loaded) -> dict[tuple[str, str], list[ScenarioResult]]:
    out: dict[tuple[str, str], list[ScenarioResult]] = {}
    for s in lo.result.scenarios:
        out.setdefault((s.name, s.arm_name), []).append(s)
    return {k: sorted(v, key=lambda s: s.repeat) for k, v in out.items()}


def _requests_for(lo: Loaded, scenario: ScenarioResult | str, arm: str, arm_toggles: dict[str, str]) -> list[dict]:
    name = scenario if isinstance(scenario, str) else scenario.name
    return [r for r in lo.requests if r.get("scenario") == name and r.get("arm") in (arm, arm_toggles)]


def _side(lo: Loaded, scenario: str, arm: str, reps: list[ScenarioResult], warnings: list[str]) -> Side:
    ok = [s for s in reps if s.status == "ok"]
    bad = [s for s in reps if s.status != "ok"]
    for s in bad:
        warnings.append(
            f"{lo.label}: {scenario}/{arm} repeat {s.repeat} is {s.status}"
            + (f" ({s.message})" if s.message else "")
            + "; left out"
        )
    ok_repeats = {s.repeat for s in ok}
    toggles = reps[0].arm if reps else {}
    reqs = [r for r in _requests_for(lo, scenario, arm, toggles) if r.get("repeat", 0) in ok_repeats]
    return Side(lo, scenario, arm, ok, reqs)


def align(a: Loaded, b: Loaded | None) -> tuple[list[tuple[Side, Side, bool]], list[str]]:
    """Pairs of sides to compare and whether their repeats are interleaved (pairable), plus warnings."""
    warnings: list[str] = []
    pairs: list[tuple[Side, Side, bool]] = []
    ga = _groups(a)
    if b is None:
        arms = list(dict.fromkeys(arm for _, arm in ga))
        if len(arms) < 2:
            raise PerfkitError(
                f"{a.path}: has one arm ({arms[0] if arms else 'none'}); pass a second result file to compare against"
            )
        base = arms[0]
        for scen in dict.fromkeys(name for name, _ in ga):
            if (scen, base) not in ga:
                continue
            for other in arms[1:]:
                if (scen, other) in ga:
                    sa = _side(a, scen, base, ga[(scen, base)], warnings)
                    sb = _side(a, scen, other, ga[(scen, other)], warnings)
                    pairs.append((sa, sb, True))
        return pairs, warnings
    gb = _groups(b)
    arms_a = list(dict.fromkeys(arm for _, arm in ga))
    arms_b = list(dict.fromkeys(arm for _, arm in gb))
    same_arms = set(arms_a) == set(arms_b) and len(arms_a) > 1
    if not same_arms and (len(arms_a) > 1 or len(arms_b) > 1):
        warnings.append(
            f"arms differ between files ({', '.join(arms_a)} vs {', '.join(arms_b)}); "
            f"comparing the first arm of each ({arms_a[0]} vs {arms_b[0]})"
        )
    names_b = {name for name, _ in gb}
    for scen in dict.fromkeys(name for name, _ in ga):
        if scen not in names_b:
            warnings.append(f"scenario {scen} is only in {a.label}")
            continue
        arm_pairs = [(x, x) for x in arms_a] if same_arms else [(arms_a[0], arms_b[0])]
        for arm_a, arm_b in arm_pairs:
            if (scen, arm_a) in ga and (scen, arm_b) in gb:
                pairs.append(
                    (
                        _side(a, scen, arm_a, ga[(scen, arm_a)], warnings),
                        _side(b, scen, arm_b, gb[(scen, arm_b)], warnings),
                        False,
                    )
                )
    for scen in dict.fromkeys(name for name, _ in gb):
        if scen not in {name for name, _ in ga}:
            warnings.append(f"scenario {scen} is only in {b.label}")
    if not pairs:
        raise PerfkitError(f"no scenario names in common between {a.path} and {b.path}")
    return pairs, warnings


# --------------------------------------------------------------------------------------------------------------
# comparability
# --------------------------------------------------------------------------------------------------------------


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def comparability_warnings(a: Loaded, b: Loaded, pairs: Iterable[tuple[Side, Side, bool]]) -> list[str]:
    """Reasons the two sides may not be comparable: hardware, software, model, workload or a dirty tree."""
    out: list[str] = []
    pairs = list(pairs)
    pa, pb = a.result.provenance or {}, b.result.provenance or {}
    if a is not b:
        ga, gb = pa.get("gpu") or {}, pb.get("gpu") or {}
        if bool(ga.get("available", "name" in ga)) != bool(gb.get("available", "name" in gb)):
            out.append(f"GPU availability differs: A {_gpu_name(pa)}, B {_gpu_name(pb)}")
        else:
            for key, what in (
                ("name", "GPU"),
                ("driver", "driver"),
                ("cuda_driver", "CUDA driver"),
                ("device_count", "GPU count"),
                ("power_limit_w", "power limit"),
                ("sm_clock_max_mhz", "max SM clock"),
            ):
                va, vb = ga.get(key), gb.get(key)
                if va is not None and vb is not None and va != vb:
                    out.append(f"{what} differs: A {va}, B {vb}")
        pk_a, pk_b = pa.get("packages") or {}, pb.get("packages") or {}
        diffs = [
            f"{n} {pk_a.get(n)} → {pk_b.get(n)}"
            for n in sorted(set(pk_a) | set(pk_b))
            if n != "perfkit" and pk_a.get(n) != pk_b.get(n)
        ]
        if diffs:
            out.append("package versions differ: " + ", ".join(diffs))
        for sa, sb, _ in pairs:  # the model each compared scenario ran (a suite may run several)
            ma = scenario_model_config(a.result.config, sa.scenario)
            mb = scenario_model_config(b.result.config, sb.scenario)
            for key in ("preset", "path", "weights", "dtype", "quant", "num_layers", "sliding_window"):
                msg = f"model.{key} differs: A {ma.get(key)}, B {mb.get(key)}"
                if ma.get(key) != mb.get(key) and msg not in out:
                    out.append(msg)
    dirty = [name for name, p in (("A", pa), ("B", pb)) if _get(p, "git", "dirty")]
    if a is b and dirty:
        out.append("run from a dirty git tree: the commit does not identify the code measured")
    elif dirty:
        out.append(f"{' and '.join(dirty)} ran from a dirty git tree: the commit does not identify the code measured")
    for sa, sb, _ in pairs:
        ha = {s.workload.hash for s in sa.repeats if s.workload is not None}
        hb = {s.workload.hash for s in sb.repeats if s.workload is not None}
        if ha and hb and ha != hb:
            who = (sa.arm, sb.arm) if sa.loaded is sb.loaded else ("A", "B")
            out.append(
                f"{sa.scenario}: workload differs between {who[0]} and {who[1]} "
                f"(hash {', '.join(sorted(ha))} vs {', '.join(sorted(hb))})"
            )
        same_file = sa.loaded is sb.loaded
        for side, who in ((sa, sa.arm if same_file else "A"), (sb, sb.arm if same_file else "B")):
            jit = [(s.repeat, (s.runtime.get("jit_compiles") or {})) for s in side.repeats]
            hit = [(r, j) for r, j in jit if j.get("compiles")]
            if hit:
                detail = ", ".join(f"repeat {r}: {j['compiles']} in {j.get('seconds', 0):.2f} s" for r, j in hit)
                out.append(f"{sa.scenario}: {who} compiled Triton kernels inside its measured window ({detail}): its "
                           f"times include the compiles")  # fmt: skip
        choices = [_gemv_choices(side) for side in (sa, sb)]
        if None not in choices and choices[0] != choices[1]:
            ca, cb = choices
            who = (sa.arm, sb.arm) if same_file else ("A", "B")
            diff = ", ".join(f"{k} {ca.get(k, '-')} / {cb.get(k, '-')}" for k in sorted(set(ca) | set(cb))
                             if ca.get(k) != cb.get(k))  # fmt: skip
            out.append(f"{sa.scenario}: decode_gemv=auto timed a different kernel choice per weight shape, {who[0]} / "
                       f"{who[1]}: {diff}: the deltas include the choice")  # fmt: skip
        clocks = [_mean_sm_clock(side) for side in (sa, sb)]
        if None not in clocks and abs(clocks[1] / clocks[0] - 1) * 100 > CLOCK_WARN_PCT:  # type: ignore[operator]
            who = (sa.arm, sb.arm) if same_file else ("A", "B")
            out.append(f"{sa.scenario}: the mean SM clock differs, {who[0]} {clocks[0]:.0f} MHz, {who[1]} "
                       f"{clocks[1]:.0f} MHz (NVML): the deltas include the clock difference")  # fmt: skip
    return out


def _gemv_choices(side: Side) -> dict[str, str] | None:
    """decode_gemv=auto's kernel per weight shape ("NxK" -> a gemv tile or "cublas") from a side's first repeat;
    None for other modes and older results. Two runs (or GPUs) can time a near-tie differently."""
    g = side.repeats[0].runtime.get("decode_gemv") if side.repeats else None
    if not isinstance(g, dict) or g.get("mode") != "auto":
        return None
    return {k: str(v.get("best") if isinstance(v, dict) else v) for k, v in (g.get("shapes") or {}).items()}


def _mean_sm_clock(side: Side) -> float | None:
    """The mean NVML SM clock over a side's repeats; None where a repeat has no telemetry."""
    vals = [_repeat_value(s, "telemetry.sm_clock_mhz.mean") for s in side.repeats]
    return None if not vals or None in vals or not all(vals) else math.fsum(vals) / len(vals)  # type: ignore[arg-type]


def _gpu_name(p: dict[str, Any]) -> str:
    g = p.get("gpu") or {}
    if g.get("available") is False:
        return "no GPU"
    return str(g.get("name") or "unknown GPU")


def provenance_line(a: Loaded, b: Loaded) -> str:
    pa, pb = a.result.provenance or {}, b.result.provenance or {}

    def gpu(p: dict[str, Any]) -> str:
        g = p.get("gpu") or {}
        name = _gpu_name(p)
        return f"{name} (driver {g['driver']})" if g.get("driver") else name

    def model(cfg: dict[str, Any]) -> str:
        return ", ".join(dict.fromkeys(model_text(m) for _, m in suite_models(cfg)))

    def quants(cfg: dict[str, Any]) -> str:
        return ", ".join(dict.fromkeys(str(m.get("quant") or "?") for _, m in suite_models(cfg)))

    def commit(p: dict[str, Any]) -> str:
        g = p.get("git") or {}
        sha = g.get("short") or (g.get("sha") or "")[:10] or "?"
        return f"`{sha}`" + (" (dirty)" if g.get("dirty") else "")

    def both(fa: str, fb: str) -> str:
        return fa if fa == fb else f"{fa} → {fb}"

    quant = both(quants(a.result.config), quants(b.result.config))
    return (
        f"GPU: {both(gpu(pa), gpu(pb))} · model: {both(model(a.result.config), model(b.result.config))} · "
        f"quant: {quant} · commit: {both(commit(pa), commit(pb))}"
    )


# --------------------------------------------------------------------------------------------------------------
# the comparison itself
# --------------------------------------------------------------------------------------------------------------


def _request_values(side: Side, dist: str) -> np.ndarray:
    if dist == "per_user_tok_s":
        t = [r.get("tpot_ms") for r in side.requests]
        return np.asarray([1000.0 / x for x in t if x is not None and x > 0], dtype=float)
    v = [r.get(dist) for r in side.requests]
    return np.asarray([x for x in v if x is not None], dtype=float)


def _itl_groups(side: Side) -> list[np.ndarray]:
    out = []
    for r in side.requests:
        ts = r.get("token_ns") or []
        if len(ts) >= 2:
            out.append(np.diff(np.asarray(ts, dtype=np.int64)).astype(float) / 1e6)
    return out


def _seed(path: str, scenario: str, seed: int) -> int:
    return (zlib.crc32(f"{scenario}|{path}".encode()) + seed) % (2**32)


def compare_metric(
    a: Side,
    b: Side,
    path: str,
    paired: bool,
    *,
    seed: int = 0,
    n_resamples: int = st.DEFAULT_RESAMPLES,
    confidence: float = 0.95,
) -> MetricRow | None:
    """One row, or None when the metric is missing on either side."""
    m = validate_metric(path)
    label, unit = metric_label(path)
    dir_ = _direction(path)
    va = [(s.repeat, _repeat_value(s, path)) for s in a.repeats]
    vb = [(s.repeat, _repeat_value(s, path)) for s in b.repeats]
    va = [(r, v) for r, v in va if v is not None]
    vb = [(r, v) for r, v in vb if v is not None]
    if not va or not vb:
        return None
    rseed = _seed(path, a.scenario, seed)
    d: st.DeltaCI | None = None
    method = "none"
    if len(va) >= 3 and len(vb) >= 3:
        if paired:
            common = sorted({r for r, _ in va} & {r for r, _ in vb})
            da, db = dict(va), dict(vb)
            pa_, pb_ = [da[r] for r in common], [db[r] for r in common]
            pair_ok = len(common) >= 3
        else:
            pair_ok = False
        if pair_ok:
            d = st.compare_values(pa_, pb_, m["stat"] or "mean", paired=True, per_repeat=True, confidence=confidence)
        else:
            d = st.compare_values(
                [v for _, v in va], [v for _, v in vb], "mean", paired=False, per_repeat=True, confidence=confidence
            )
        method = d.method
    elif m["dist"]:
        stat = m["stat"]
        if m["dist"] == "itl_ms":
            ga, gb = _itl_groups(a), _itl_groups(b)
            if len(ga) >= 2 and len(gb) >= 2:
                pt, lo, hi = st.cluster_bootstrap_delta_pct(ga, gb, stat, n_resamples, rseed, confidence)
                xa, xb = np.concatenate(ga), np.concatenate(gb)
                d = st.DeltaCI(
                    float(st.statistic(xa, stat)),
                    float(st.statistic(xb, stat)),
                    pt,
                    lo,
                    hi,
                    "cluster-bootstrap",
                    len(ga),
                    len(gb),
                    True,
                    confidence,
                )
                method = d.method
        else:
            xa, xb = _request_values(a, m["dist"]), _request_values(b, m["dist"])
            if xa.size >= 2 and xb.size >= 2:
                d = st.compare_values(
                    xa,
                    xb,
                    stat,
                    paired=False,
                    per_repeat=False,
                    seed=rseed,
                    n_resamples=n_resamples,
                    confidence=confidence,
                )
                method = d.method
    if d is None:
        ma = float(np.mean([v for _, v in va]))
        mb = float(np.mean([v for _, v in vb]))
        delta = 100 * (mb - ma) / ma if ma else None
        return MetricRow(path, label, unit, dir_, ma, mb, delta, None, None, "n/a", "none", len(va), len(vb))
    return MetricRow(
        path,
        label,
        unit,
        dir_,
        d.a,
        d.b,
        d.delta_pct,
        d.lo_pct,
        d.hi_pct,
        st.verdict(d.lo_pct, d.hi_pct, dir_),
        method,
        d.n_a,
        d.n_b,
    )


def _noise_notes(a: Side, b: Side, metrics: list[str]) -> list[str]:
    """CV, slow-first-repeat and outlier-repeat diagnostics on the headline metrics (p50/mean, throughput,
    memory); per-repeat p90/p99 wobble by nature and would only add noise about the noise. NVML's rows are
    context, not measurements of the code (a throttled fraction near 0 has a meaningless CV): left out."""
    notes: list[str] = []
    heads = [p for p in metrics if p.endswith((".p50", ".mean")) or p in THROUGHPUTS or p.startswith("memory.")]
    heads = [p for p in heads if not p.startswith("telemetry.")]
    for side in (a, b):
        if len(side.repeats) < 3:
            continue
        diags: dict[str, st.Noise] = {}
        for path in heads:
            pairs = [(s.repeat, _repeat_value(s, path)) for s in side.repeats]
            pairs = [(r, v) for r, v in pairs if v is not None]
            if len(pairs) >= 3:
                diags[metric_label(path)[0]] = st.noise([v for _, v in pairs], _direction(path), [r for r, _ in pairs])
        notes += st.noise_warnings(side.arm, diags)
    return notes


def compare(
    a_path: str | Path,
    b_path: str | Path | None = None,
    metrics: Sequence[str] | None = None,
    *,
    seed: int = 0,
    n_resamples: int = st.DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    extra_metrics: Sequence[str] = (),
) -> Report:
    """Load, align and compare. `metrics`: patterns selecting rows (default: the standard PR set)."""
    return compare_loaded(
        load(a_path),
        None if b_path is None else load(b_path),
        metrics,
        seed=seed,
        n_resamples=n_resamples,
        confidence=confidence,
        extra_metrics=extra_metrics,
    )


def compare_loaded(
    a: Loaded,
    b: Loaded | None,
    metrics: Sequence[str] | None = None,
    *,
    seed: int = 0,
    n_resamples: int = st.DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    extra_metrics: Sequence[str] = (),
) -> Report:
    pairs, warnings = align(a, b)
    bb = b if b is not None else a
    comparisons: list[Comparison] = []
    for sa, sb, paired in pairs:
        if not sa.repeats or not sb.repeats:
            warnings.append(f"{sa.scenario}: no ok repeat for {sa.arm if not sa.repeats else sb.arm}; skipped")
            continue
        paths = available_metrics(sa.repeats[0]) if metrics else default_metrics(sa.repeats[0])
        paths = _select(paths, metrics) + [p for p in extra_metrics if p not in _select(paths, metrics)]
        rows = [
            r
            for p in paths
            if (r := compare_metric(sa, sb, p, paired, seed=seed, n_resamples=n_resamples, confidence=confidence))
            is not None
        ]
        notes = _noise_notes(sa, sb, [r.metric for r in rows])
        if len(sa.repeats) != len(sb.repeats):
            notes.append(f"repeat counts differ: {sa.arm} {len(sa.repeats)}, {sb.arm} {len(sb.repeats)}")
        comparisons.append(Comparison(sa.scenario, sa, sb, rows, notes))
    warnings = comparability_warnings(a, bb, pairs) + warnings
    return Report(a, bb, comparisons, warnings, provenance_line(a, bb), confidence)


# --------------------------------------------------------------------------------------------------------------
# --fail-if
# --------------------------------------------------------------------------------------------------------------

_THRESH_RE = re.compile(r"^(?P<metric>[^:]+):(?P<pct>[+-]?\d+(?:\.\d+)?)%$")


@dataclass(frozen=True)
class Threshold:
    """`metric:+5%`: fail when the delta crosses `pct` going the metric's bad direction (up for latencies
    and memory, down for throughputs). An unsigned value means the bad direction; a value of the good sign
    demands an improvement of at least that much (`tpot_ms.p50:-5%` fails unless TPOT dropped by 5 %)."""

    metric: str
    pct: float
    raw: str

    def crossed(self, delta_pct: float) -> bool:
        return delta_pct > self.pct if _direction(self.metric) == "lower" else delta_pct < self.pct


def parse_threshold(text: str) -> Threshold:
    m = _THRESH_RE.match(text.strip().replace(" ", ""))
    if m is None:
        raise PerfkitError(f"--fail-if {text!r}: expected METRIC:[+|-]PERCENT%, e.g. tpot_ms.p50:+5%")
    metric = m["metric"]
    validate_metric(metric)
    raw_pct = m["pct"]
    pct = float(raw_pct)
    if raw_pct[0] not in "+-" and _direction(metric) == "higher":
        pct = -pct  # unsigned = the bad direction
    return Threshold(metric, pct, text)


def check_thresholds(report: Report, thresholds: Sequence[Threshold]) -> list[str]:
    """One line per crossed threshold (empty = pass). A threshold on a metric no comparison has is an error."""
    failures: list[str] = []
    for t in thresholds:
        rows = [(c, c.row(t.metric)) for c in report.comparisons]
        rows = [(c, r) for c, r in rows if r is not None and r.delta_pct is not None]
        if not rows:
            raise PerfkitError(f"--fail-if {t.raw}: metric {t.metric} is not in the compared results")
        for c, r in rows:
            if t.crossed(r.delta_pct):  # type: ignore[arg-type]
                sig = "significant" if r.verdict in ("better", "worse") else f"CI {_ci_text(r)}, {r.verdict}"
                failures.append(
                    f"{c.scenario} {c.b.arm} vs {c.a.arm}: {t.metric} {r.delta_pct:+.2f}% crosses {t.pct:+g}% ({sig})"
                )
    return failures


# --------------------------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------------------------


def fmt_value(v: float | None, unit: str) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    if unit == "GiB":
        return f"{v / 2**30:.2f}"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 10:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _p(v: float) -> str:
    return f"{v:+.1f}%" if abs(v) < 1000 else f"{v:+.0f}%"


def _ci_text(r: MetricRow) -> str:
    return f"[{_p(r.lo_pct)}, {_p(r.hi_pct)}]" if r.lo_pct is not None and r.hi_pct is not None else "no CI"


def delta_text(r: MetricRow) -> str:
    if r.delta_pct is None or not math.isfinite(r.delta_pct):
        return "—"
    return f"{_p(r.delta_pct)} {_ci_text(r)}"


def method_text(c: Comparison, confidence: float) -> str:
    methods = {r.method for r in c.rows}
    k = min(len(c.a.repeats), len(c.b.repeats))
    parts = []
    if "paired-t" in methods:
        parts.append(f"paired t-interval over {k} interleaved repeats per arm")
    if "welch-t" in methods:
        parts.append(f"Welch t-interval over repeats ({len(c.a.repeats)} vs {len(c.b.repeats)}, not interleaved)")
    if methods & {"bootstrap", "cluster-bootstrap"}:
        parts.append(
            f"bootstrap over per-request values ({st.DEFAULT_RESAMPLES} resamples; ITL resamples "
            "whole requests) — **within-run only**: run-to-run noise is not in the interval, repeat ≥ 3× "
            "for a trustworthy CI"
        )
    if "none" in methods:
        parts.append("no CI for per-run scalars (throughput, memory, NVTX) with < 3 repeats")
    return f"{int(round(confidence * 100))}% CI: " + "; ".join(parts) + "."


def comparison_title(report: Report, c: Comparison) -> str:
    """'<scenario> (<model>) · A = ..., B = ...' (Markdown backticks around labels)."""
    ca, cb = report.a.result.config, report.b.result.config
    ma, mb = scenario_model(ca, c.scenario, always=True), scenario_model(cb, c.scenario, always=True)
    named = len(suite_models(ca)) > 1 or len(suite_models(cb)) > 1 or ma != mb  # one same model: not repeated
    what = c.scenario + ("" if not named else f" ({ma})" if ma == mb else f" ({ma} → {mb})")
    if report.a is report.b:
        return f"{what} · A = `{c.a.arm}`, B = `{c.b.arm}`"

    def side(label: str, arm: str) -> str:
        return f"`{label}`" + ("" if arm == "default" else f" ({arm})")

    return f"{what} · A = {side(report.a.label, c.a.arm)}, B = {side(report.b.label, c.b.arm)}"


def to_markdown(report: Report, images: Sequence[tuple[str, str]] = ()) -> str:
    """PR-ready Markdown: provenance line, one table per comparison, method, warnings, definitions, images."""
    lines = ["## perfkit compare", "", report.provenance_line, ""]
    ci_head = f"Δ % ({int(round(report.confidence * 100))}% CI)"
    for c in report.comparisons:
        lines += [
            f"### {comparison_title(report, c)}",
            "",
            f"| metric | A | B | {ci_head} | verdict |",
            "| --- | ---: | ---: | ---: | --- |",
        ]
        for r in c.rows:
            lines.append(
                f"| {r.label} ({r.unit}) | {fmt_value(r.a, r.unit)} | {fmt_value(r.b, r.unit)} | "
                f"{delta_text(r)} | {VERDICT_MARK[r.verdict]} |"
            )
        lines += ["", f"<sub>{method_text(c, report.confidence)}</sub>", ""]
        if c.notes:
            lines += ["Noise:", ""] + [f"- {n}" for n in c.notes] + [""]
    if report.warnings:
        lines += ["> [!WARNING]", "> Comparability:"] + [f"> - {w}" for w in report.warnings] + [""]
    for title, path in images:
        lines += [f"![{title}]({path})", ""]
    lines += [f"<sub>{DEFINITIONS}</sub>", ""]
    return "\n".join(lines)


def render_rich(report: Report, console: Any) -> None:
    """Print the comparison as rich tables."""
    from rich.table import Table

    style = {"better": "green", "worse": "red", "no significant change": "dim", "n/a": "dim"}
    console.print(report.provenance_line.replace("`", ""))
    for c in report.comparisons:
        t = Table(title=comparison_title(report, c).replace("`", ""), title_justify="left")
        t.add_column("metric")
        t.add_column("A", justify="right")
        t.add_column("B", justify="right")
        t.add_column(f"Δ % ({int(round(report.confidence * 100))}% CI)", justify="right")
        t.add_column("verdict")
        for r in c.rows:
            s = style[r.verdict]
            t.add_row(
                f"{r.label} ({r.unit})",
                fmt_value(r.a, r.unit),
                fmt_value(r.b, r.unit),
                delta_text(r),
                f"[{s}]{r.verdict}[/{s}]",
            )
        console.print(t)
        console.print(method_text(c, report.confidence).replace("**", ""), style="dim")
        for n in c.notes:
            console.print(f"noise: {n}", style="yellow")
    for w in report.warnings:
        console.print(f"warning: {w}", style="bold yellow")
    console.print(DEFINITIONS, style="dim")
