"""Versioned result schema and the run directory.

`results/<run-id>/result.json` holds one suite run: the resolved config, provenance, and one entry per
(scenario, arm, repeat). The writer flushes the whole file after every scenario with an atomic replace
(write a temp file in the same directory, fsync, rename), so a crash or Ctrl-C mid-run never leaves a corrupt
file and never loses a finished scenario. `requests.jsonl` gets one line per measured request.

Readers reject files of an unknown schema version with a message saying which versions this perfkit reads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from perfkit.config import model_names
from perfkit.errors import PerfkitError

SCHEMA_VERSION = 1
READABLE_VERSIONS = (1,)


def _model() -> ConfigDict:
    return ConfigDict(extra="forbid")


class Stats(BaseModel):
    """Summary of a distribution. Percentiles use linear interpolation (numpy's default, stated in the file)."""

    model_config = _model()

    n: int
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


class Throughput(BaseModel):
    model_config = _model()

    output_tok_s: float
    total_tok_s: float
    request_s: float
    goodput_request_s: float | None = None
    goodput_fraction: float | None = None
    output_tok_s_per_gpu: float | None = None  # output_tok_s / tensor-parallel world size (the engine runner)
    total_tok_s_per_gpu: float | None = None


class Counts(BaseModel):
    """Token and request counts as the engine saw them (never the client's intent)."""

    model_config = _model()

    requests: int
    warmup_requests: int = 0
    input_text_tokens: int
    input_vision_tokens: int
    output_tokens: int
    duration_s: float
    preemptions: int = 0


class PhaseMemory(BaseModel):
    model_config = _model()

    peak_allocated_bytes: int
    peak_reserved_bytes: int


class MemorySection(BaseModel):
    """Peak CUDA memory per phase. `available: false` with a reason on CPU or when capture is off."""

    model_config = _model()

    available: bool
    reason: str | None = None
    phases: dict[str, PhaseMemory] = Field(default_factory=dict)
    weights_bytes: int | None = None
    kv_pool_bytes: int | None = None
    alloc_retries: int | None = None
    num_ooms: int | None = None


class RangeStats(BaseModel):
    """One NVTX range's in-process timings (ms). Device timings from CUDA events when available."""

    model_config = _model()

    count: int
    host_total_ms: float
    host_mean_ms: float
    host_p50_ms: float
    host_p99_ms: float
    device_total_ms: float | None = None
    device_mean_ms: float | None = None
    device_p50_ms: float | None = None
    device_p99_ms: float | None = None


class TelemetrySection(BaseModel):
    """NVML summary per scenario: {metric: {mean, max}}; the time series lies in the run directory."""

    model_config = _model()

    available: bool
    reason: str | None = None
    interval_ms: int | None = None
    samples: int = 0
    summary: dict[str, dict[str, float]] = Field(default_factory=dict)
    throttle_reasons: list[str] = Field(default_factory=list)
    series_file: str | None = None


class RooflineSection(BaseModel):
    """Distance from the hardware limit for this scenario's steps."""

    model_config = _model()

    gpu: str | None = None
    decode_bound_ms: float | None = None
    decode_bytes: float | None = None
    prefill_bound_ms: float | None = None
    prefill_flops: float | None = None
    mbu: float | None = None
    mfu: float | None = None
    output_tok_s_bound: float | None = None  # closed-loop throughput ceiling (roofline.serving_bound)
    output_tok_s_bound_serial: float | None = None  # the same when a step's kernels run one after another
    throughput_fraction: float | None = None  # measured output_tok_s / output_tok_s_bound
    notes: str | None = None


class WorkloadInfo(BaseModel):
    model_config = _model()

    spec: dict[str, Any]
    hash: str


class ScenarioResult(BaseModel):
    """One (scenario, arm, repeat). `status` is ok, oom (out of GPU memory, run continued) or error."""

    model_config = _model()

    name: str
    arm_name: str = "default"
    arm: dict[str, str]
    repeat: int = 0
    status: Literal["ok", "oom", "error"] = "ok"
    message: str | None = None
    runner: str = "engine"
    workload: WorkloadInfo | None = None
    runtime: dict[str, Any] = Field(default_factory=dict)
    counts: Counts | None = None
    metrics: dict[str, Stats] = Field(default_factory=dict)
    throughput: Throughput | None = None
    memory: MemorySection | None = None
    nvtx: dict[str, RangeStats] = Field(default_factory=dict)
    telemetry: TelemetrySection | None = None
    roofline: RooflineSection | None = None
    started_unix_s: float | None = None


class KernelRow(BaseModel):
    """One (kernel, shape, impl) measurement of a kernel sweep. `skipped`: not attempted (e.g. on a CPU, a shape
    whose predicted peak exceeds the memory budget)."""

    model_config = ConfigDict(extra="allow")

    kernel: str
    impl: str
    shape: dict[str, Any]
    status: Literal["ok", "oom", "error", "skipped"] = "ok"
    message: str | None = None
    peak_allocated_bytes: int | None = None
    output_bytes: int | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    bound_ms: float | None = None


class Result(BaseModel):
    """The whole `result.json`."""

    model_config = _model()

    schema_version: int = SCHEMA_VERSION
    run_id: str
    command: str
    config: dict[str, Any]
    provenance: dict[str, Any]
    percentile_method: str = "linear"
    created_unix_s: float = Field(default_factory=time.time)
    status: Literal["running", "complete", "interrupted", "failed"] = "running"
    scenarios: list[ScenarioResult] = Field(default_factory=list)
    kernels: list[KernelRow] | None = None


# --------------------------------------------------------------------------------------------------------------
# Which model a scenario result ran (a suite may run several: `models:`)
# --------------------------------------------------------------------------------------------------------------


def suite_models(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, model config) of each model a result's suite ran: ``models``, or the single ``model`` (a result's
    ``model`` is only a default when ``models`` is set)."""
    models = cfg.get("models") or [cfg.get("model") or {}]
    return list(zip(model_names([(m.get("preset"), m.get("path")) for m in models]), models, strict=True))


def model_text(m: dict[str, Any]) -> str:
    name = m.get("preset") or (Path(m["path"]).name if m.get("path") else "?")
    return name + (f", {m['num_layers']} layers" if m.get("num_layers") else "")


def scenario_model_config(cfg: dict[str, Any], scenario: str) -> dict[str, Any]:
    """The model config a scenario result ran: the suite's only model, or the one its "<model>/" prefix names
    ({} when none matches)."""
    models = suite_models(cfg)
    if len(models) == 1:
        return models[0][1]
    prefix = scenario.partition("/")[0]
    return next((m for name, m in models if name == prefix), {})


def suite_scenario_name(cfg: dict[str, Any], scenario: str) -> str:
    """The config's name of a scenario result: "31b-2/c1" -> "c1" in a several-model suite, else unchanged."""
    prefix, sep, rest = scenario.partition("/")
    names = [name for name, _ in suite_models(cfg)]
    return rest if sep and len(names) > 1 and prefix in names else scenario


def scenario_model(cfg: dict[str, Any], scenario: str, always: bool = False) -> str | None:
    """'<model> <quant>' of a scenario ("31b-2/c1" -> "31b nvfp4"); None for a one-model suite unless ``always``."""
    m = scenario_model_config(cfg, scenario) if always or len(suite_models(cfg)) > 1 else {}
    return f"{model_text(m)} {m.get('quant') or '?'}" if m else None


# --------------------------------------------------------------------------------------------------------------


def make_run_id(config_name: str, label: str | None = None, now: float | None = None) -> str:
    """`<UTC yyyymmdd-hhmmss>-<config>[-<label>]`: sortable, readable, unique enough per machine."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    parts = [stamp, config_name] + ([label] if label else [])
    return "-".join(parts)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees either the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunWriter:
    """Owns `results/<run-id>/`: flushes result.json after every scenario, appends requests.jsonl."""

    def __init__(self, out_dir: str | Path, result: Result):
        self.dir = Path(out_dir) / result.run_id
        if self.dir.exists() and any(self.dir.iterdir()):
            raise PerfkitError(f"run directory {self.dir} already exists and is not empty; pass another --label")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.result = result
        self.flush()

    @property
    def result_path(self) -> Path:
        return self.dir / "result.json"

    def add_scenario(self, scenario: ScenarioResult, requests: list[dict[str, Any]] | None = None) -> None:
        """Append one finished scenario (and its per-request lines) and flush to disk."""
        if requests:
            with open(self.dir / "requests.jsonl", "a") as f:
                for r in requests:
                    f.write(json.dumps(r, separators=(",", ":")) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.result.scenarios.append(scenario)
        self.flush()

    def finish(self, status: Literal["complete", "interrupted", "failed"]) -> Path:
        self.result.status = status
        self.flush()
        return self.result_path

    def flush(self) -> None:
        atomic_write_text(self.result_path, self.result.model_dump_json(indent=2) + "\n")


def write_result(path: str | Path, result: Result) -> Path:
    """Write a complete result file in one atomic step (kernel sweeps, tests)."""
    p = Path(path)
    atomic_write_text(p, result.model_dump_json(indent=2) + "\n")
    return p


def read_result(path: str | Path) -> Result:
    """Load and validate a result file; a directory means its result.json."""
    p = Path(path)
    if p.is_dir():
        p = p / "result.json"
    if not p.is_file():
        raise PerfkitError(f"result file not found: {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise PerfkitError(f"{p}: not valid JSON ({err.msg} at line {err.lineno}); is it a perfkit result?") from None
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise PerfkitError(f"{p}: no schema_version; not a perfkit result file")
    version = raw["schema_version"]
    if version not in READABLE_VERSIONS:
        raise PerfkitError(
            f"{p}: result schema_version {version} is not supported by this perfkit "
            f"(reads {', '.join(map(str, READABLE_VERSIONS))}); use the perfkit version that wrote it"
        )
    try:
        return Result.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"])
        raise PerfkitError(f"{p}: invalid result file at {where}: {first['msg']}") from None


def read_requests(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per-request lines of a run (empty when the run wrote none)."""
    p = Path(run_dir)
    if p.is_file():
        p = p.parent
    f = p / "requests.jsonl"
    if not f.is_file():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
