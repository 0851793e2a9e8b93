"""NVML telemetry sampled on a background thread, summarised per scenario.

    tel = TelemetrySampler(device_index=0, interval_ms=100).start()   # no NVML / GPU -> available=False
    mark = tel.mark()
    ... run the scenario ...
    scenario_result.telemetry = tel.section(mark, run_dir=writer.dir, stem="decode-A-r0")
    tel.stop()

Each sample: `t_ns` (perf_counter_ns, same clock as the engine's timestamps), `unix_s`, `power_w`,
`sm_clock_mhz`, `mem_clock_mhz`, `memory_used_bytes`, `gpu_util_pct`, `mem_util_pct`, `temperature_c`,
`throttle_mask` (NVML clocks-event reasons bitmask). A metric NVML does not support on this GPU is dropped
after its first failure. `section()` summarises the samples since a mark ({metric: {mean, max}}, plus
`throttled`: the fraction of samples with a power / thermal / hardware slowdown reason), lists the throttle reasons seen
(decoded to names) and writes the window's time series to `<run_dir>/telemetry/<stem>.csv` (or `.jsonl`).

NVML is injectable: pass any object with the pynvml functions used here (tests pass a fake).
"""

from __future__ import annotations

import csv
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfkit.results import TelemetrySection

# NVML clocks-event ("throttle") reason bits, nvml.h nvmlClocksEventReason*.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
# Reasons that mean the clocks were really pulled down (power / thermal / hardware), not idle or a setting.
SLOWDOWN_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

METRICS = (
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "memory_used_bytes",
    "gpu_util_pct",
    "mem_util_pct",
    "temperature_c",
)
_COLUMNS = ("t_ns", "unix_s", *METRICS, "throttle_mask")


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the reason bits set in an NVML clocks-event mask (unknown bits as `bit_0x...`)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return names


class TelemetrySampler:
    """Samples NVML every `interval_ms` on a daemon thread between `start()` and `stop()`."""

    def __init__(
        self,
        device_index: int = 0,
        interval_ms: int = 100,
        nvml: Any = None,
        enabled: bool = True,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        max_samples: int = 2_000_000,
    ):
        self.device_index = device_index
        self.interval_ms = int(interval_ms)
        self.reason: str | None = None
        self._nvml = nvml
        self._clock_ns = clock_ns
        self._max_samples = max_samples
        self._handle: Any = None
        self._readers: dict[str, Callable[[], float | int]] = {}
        self._samples: list[dict[str, float | int | None]] = []
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._initialized = False
        if not enabled:
            self.reason = "telemetry off"
        else:
            self._init_nvml()

    @property
    def available(self) -> bool:
        return self.reason is None

    # ---- NVML setup ---------------------------------------------------------------------------------------------
    def _init_nvml(self) -> None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                self.reason = "pynvml (nvidia-ml-py) not installed"
                return
            self._nvml = pynvml
        nv = self._nvml
        try:
            nv.nvmlInit()
            self._initialized = True
            count = nv.nvmlDeviceGetCount()
            if count <= self.device_index:
                self.reason = f"no GPU at NVML index {self.device_index} ({count} GPU(s) visible)"
                return
            self._handle = nv.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {err}"
            return
        h = self._handle
        clock_sm = getattr(nv, "NVML_CLOCK_SM", 1)
        clock_mem = getattr(nv, "NVML_CLOCK_MEM", 2)
        temp_gpu = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        readers: dict[str, Callable[[], float | int]] = {
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, clock_sm),
            "mem_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, clock_mem),
            "memory_used_bytes": lambda: nv.nvmlDeviceGetMemoryInfo(h).used,
            "gpu_util_pct": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "mem_util_pct": lambda: nv.nvmlDeviceGetUtilizationRates(h).memory,
            "temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, temp_gpu),
        }
        if reasons_fn is not None:
            readers["throttle_mask"] = lambda: reasons_fn(h)
        self._readers = readers

    # ---- sampling ---------------------------------------------------------------------------------------------
    def sample_once(self) -> dict[str, float | int | None]:
        """Read every supported metric now and append the sample (the thread calls this)."""
        s: dict[str, float | int | None] = {"t_ns": self._clock_ns(), "unix_s": time.time()}
        for key, read in list(self._readers.items()):
            try:
                s[key] = read()
            except Exception:  # not supported on this GPU / transient: drop the metric for good
                self._readers.pop(key, None)
                s[key] = None
        with self._lock:
            if len(self._samples) < self._max_samples:
                self._samples.append(s)
        return s

    def _run(self) -> None:
        interval_s = self.interval_ms / 1000.0
        next_t = time.monotonic()
        while not self._stop_evt.is_set():
            self.sample_once()
            next_t += interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (slow NVML call): do not burst to catch up
                next_t = time.monotonic()
                delay = 0.0
            if self._stop_evt.wait(delay):
                break

    def start(self) -> TelemetrySampler:
        """Start the sampling thread (no-op when unavailable or already running). Returns self."""
        if not self.available or self._thread is not None:
            return self
        self._stop_evt.clear()
        self._thread = threading.Thread(target=self._run, name="perfkit-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread; shut NVML down. Safe to call twice."""
        t = self._thread
        if t is not None:
            self._stop_evt.set()
            t.join(timeout_s)
            self._thread = None
        if self._initialized:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._initialized = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- per scenario -----------------------------------------------------------------------------------------
    def mark(self) -> int:
        """Position in the sample list; pass it to `section()` to summarise what comes after."""
        with self._lock:
            return len(self._samples)

    def samples(self, since: int = 0) -> list[dict[str, float | int | None]]:
        with self._lock:
            return list(self._samples[since:])

    def section(
        self,
        since: int = 0,
        run_dir: str | Path | None = None,
        stem: str = "telemetry",
        fmt: str = "csv",
    ) -> TelemetrySection:
        """Summary of the samples since `since` (a `mark()`); writes the series when `run_dir` is given."""
        if not self.available:
            return TelemetrySection(available=False, reason=self.reason)
        window = self.samples(since)
        series_file = None
        if run_dir is not None and window:
            series_file = write_series(window, Path(run_dir) / "telemetry" / f"{stem}.{fmt}", fmt)
            try:
                series_file = str(Path(series_file).relative_to(Path(run_dir)))
            except ValueError:
                pass
        summary, reasons = summarize(window)
        return TelemetrySection(
            available=True,
            interval_ms=self.interval_ms,
            samples=len(window),
            summary=summary,
            throttle_reasons=reasons,
            series_file=series_file,
        )


def summarize(window: list[dict[str, float | int | None]]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """({metric: {mean, max}}, throttle reason names seen) over a list of samples."""
    summary: dict[str, dict[str, float]] = {}
    for key in METRICS:
        vals = [float(s[key]) for s in window if s.get(key) is not None]  # type: ignore[arg-type]
        if vals:
            summary[key] = {"mean": math.fsum(vals) / len(vals), "max": max(vals)}
    masks = [int(s["throttle_mask"]) for s in window if s.get("throttle_mask") is not None]  # type: ignore[arg-type]
    union = 0
    for m in masks:
        union |= m
    if masks:
        throttled = [1.0 if m & SLOWDOWN_MASK else 0.0 for m in masks]
        summary["throttled"] = {"mean": math.fsum(throttled) / len(throttled), "max": max(throttled)}
    return summary, decode_throttle_reasons(union)


def write_series(window: list[dict[str, float | int | None]], path: Path, fmt: str = "csv") -> str:
    """Write samples as CSV (one column per metric, empty when unsupported) or JSONL; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(_COLUMNS)
            for s in window:
                w.writerow(["" if s.get(c) is None else s[c] for c in _COLUMNS])
    elif fmt == "jsonl":
        with open(path, "w") as f:
            for s in window:
                f.write(json.dumps({c: s.get(c) for c in _COLUMNS}, separators=(",", ":")) + "\n")
    else:
        raise ValueError(f"telemetry series format {fmt!r}; allowed: csv, jsonl")
    return str(path)
