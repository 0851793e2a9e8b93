"""TelemetrySampler with a fake NVML module: readings, throttle decoding, thread start/stop, unavailable paths."""

from __future__ import annotations

import csv
import json
import threading
import time
from types import SimpleNamespace

import pytest

from perfkit.capture.telemetry import TelemetrySampler, decode_throttle_reasons
from perfkit.results import TelemetrySection


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml functions TelemetrySampler calls, with scripted values."""

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, count: int = 1, fail_init: bool = False, power_mw=(300_000, 500_000), throttle=(0x0, 0x4)):
        self.count = count
        self.fail_init = fail_init
        self.power_mw = list(power_mw)
        self.throttle = list(throttle)
        self.i = 0
        self.inits = 0
        self.shutdowns = 0
        self.lock = threading.Lock()

    def _next(self, seq):
        return seq[self.i % len(seq)]

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetPowerUsage(self, h):
        with self.lock:
            v = self._next(self.power_mw)
        return v

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=80 * 2**30, total=141 * 2**30, free=61 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=97, memory=60)

    def nvmlDeviceGetTemperature(self, h, sensor):
        raise FakeNVMLError("Not Supported")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        with self.lock:
            v = self._next(self.throttle)
            self.i += 1  # last reader of a sample advances the script
        return v


def test_decode_throttle_reasons():
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x1) == ["gpu_idle"]
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0x8 | 0x80) == ["hw_slowdown", "hw_power_brake_slowdown"]
    assert decode_throttle_reasons(0x1000) == ["bit_0x1000"]


def test_sample_summary_and_series(tmp_path):
    nv = FakeNVML()
    tel = TelemetrySampler(nvml=nv, interval_ms=50)
    assert tel.available
    m0 = tel.mark()
    for _ in range(4):
        tel.sample_once()
    sec = tel.section(m0, run_dir=tmp_path, stem="decode-A-r0")
    assert isinstance(sec, TelemetrySection)
    assert sec.available and sec.samples == 4 and sec.interval_ms == 50
    assert sec.summary["power_w"] == {"mean": pytest.approx(400.0), "max": pytest.approx(500.0)}
    assert sec.summary["sm_clock_mhz"]["max"] == 1980
    assert sec.summary["mem_clock_mhz"]["mean"] == 3201
    assert sec.summary["memory_used_bytes"]["max"] == 80 * 2**30
    assert sec.summary["gpu_util_pct"]["mean"] == 97
    assert sec.summary["mem_util_pct"]["mean"] == 60
    assert "temperature_c" not in sec.summary  # unsupported metric dropped, not zero
    assert sec.summary["throttled"] == {"mean": pytest.approx(0.5), "max": 1.0}
    assert sec.throttle_reasons == ["sw_power_cap"]
    assert sec.series_file == "telemetry/decode-A-r0.csv"
    rows = list(csv.DictReader(open(tmp_path / sec.series_file)))
    assert len(rows) == 4
    assert rows[0]["power_w"] == "300.0" and rows[0]["temperature_c"] == ""
    # only samples after a mark belong to the next scenario
    m1 = tel.mark()
    tel.sample_once()
    sec2 = tel.section(m1, run_dir=tmp_path, stem="b", fmt="jsonl")
    assert sec2.samples == 1
    lines = (tmp_path / "telemetry" / "b.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["sm_clock_mhz"] == 1980
    tel.stop()
    assert nv.shutdowns == 1


def test_thread_start_stop():
    nv = FakeNVML()
    tel = TelemetrySampler(nvml=nv, interval_ms=5)
    with tel:
        assert tel.running
        deadline = time.monotonic() + 5
        while tel.mark() < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert not tel.running
    n = tel.mark()
    assert n >= 3
    time.sleep(0.03)
    assert tel.mark() == n  # no samples after stop
    assert not any(t.name == "perfkit-telemetry" for t in threading.enumerate())
    tel.stop()  # idempotent
    assert nv.shutdowns == 1


def test_unavailable_paths():
    sec = TelemetrySampler(nvml=FakeNVML(fail_init=True)).section()
    assert sec.available is False and "Driver Not Loaded" in sec.reason and sec.summary == {}
    tel = TelemetrySampler(nvml=FakeNVML(count=0))
    assert not tel.available and "no GPU" in tel.reason
    tel.start()
    assert not tel.running
    assert tel.section().available is False
    tel.stop()
    off = TelemetrySampler(enabled=False)
    assert off.section().reason == "telemetry off"


def test_no_samples_in_window_is_empty_not_zero(tmp_path):
    tel = TelemetrySampler(nvml=FakeNVML())
    sec = tel.section(tel.mark(), run_dir=tmp_path)
    assert sec.available and sec.samples == 0 and sec.summary == {} and sec.series_file is None
