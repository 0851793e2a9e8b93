"""MemoryTracker: CPU reports not available; per-phase peaks and nesting against a fake allocator; profiler window."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from perfkit.capture.memory import MemoryTracker
from perfkit.capture.profiler import ProfileWindow, kernel_summary
from perfkit.results import MemorySection


class FakeAllocator:
    """torch.cuda's memory functions over a scripted allocator."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_alloc = 0
        self.peak_res = 0
        self.retries = 0
        self.ooms = 0
        self.resets = 0

    def is_available(self) -> bool:
        return True

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak_alloc = max(self.peak_alloc, self.allocated)
        self.peak_res = max(self.peak_res, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak_alloc

    def max_memory_reserved(self, device=None) -> int:
        return self.peak_res

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak_alloc = self.allocated
        self.peak_res = self.reserved

    def memory_stats(self, device=None) -> dict:
        return {"num_alloc_retries": self.retries, "num_ooms": self.ooms}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cpu_reports_not_available_never_zeros():
    mem = MemoryTracker()
    with mem.phase("weights_load"):
        pass
    sec = mem.section()
    assert isinstance(sec, MemorySection)
    assert sec.available is False and sec.reason == "no CUDA device"
    assert sec.phases == {} and sec.weights_bytes is None and sec.alloc_retries is None and sec.num_ooms is None


def test_disabled_reason():
    assert MemoryTracker(enabled=False).section().reason == "memory capture off"


def test_phases_nesting_and_scenario_scope():
    a = FakeAllocator()
    mem = MemoryTracker(cuda=a)
    with mem.phase("weights_load"):
        a.alloc(1000)
    with mem.phase("kv_pool"):
        a.alloc(500)
    mem.set_kv_pool_bytes(512)  # exact value wins over the allocated delta
    with mem.phase("warmup"):
        a.alloc(300)
        a.free(300)
    a.retries = 2  # before the scenario: not counted in it
    with mem.phase("scenario:decode"):
        a.alloc(100)  # 1600
        with mem.phase("build_mask"):
            a.alloc(50)  # 1650
            a.free(50)
        a.alloc(200)  # 1800: the scenario peak is after the sub-phase
        a.free(300)  # 1500
        with mem.phase("build_mask"):
            a.alloc(20)
            a.free(20)
        a.ooms += 1
        a.retries += 1
    sec = mem.section()
    assert sec.available
    assert sec.phases["weights_load"].peak_allocated_bytes == 1000
    assert sec.phases["kv_pool"].peak_allocated_bytes == 1500
    assert sec.phases["warmup"].peak_allocated_bytes == 1800
    assert sec.phases["scenario:decode"].peak_allocated_bytes == 1800
    assert sec.phases["build_mask"].peak_allocated_bytes == 1650  # max over occurrences
    assert sec.phases["scenario:decode"].peak_reserved_bytes == 1800
    assert sec.weights_bytes == 1000 and sec.kv_pool_bytes == 512
    assert sec.alloc_retries == 1 and sec.num_ooms == 1
    # a new scenario drops the previous scenario's phases, keeps setup phases
    with mem.phase("scenario:prefill"):
        a.alloc(10)
    sec2 = mem.section()
    assert "scenario:decode" not in sec2.phases and "build_mask" not in sec2.phases
    assert sec2.phases["scenario:prefill"].peak_allocated_bytes == 1510
    assert sec2.phases["weights_load"].peak_allocated_bytes == 1000
    assert sec2.alloc_retries == 0 and sec2.num_ooms == 0


def test_repeated_subphase_is_sampled():
    a = FakeAllocator()
    mem = MemoryTracker(cuda=a, sample_first=2, sample_stride=4)
    with mem.phase("scenario:s"):
        resets0 = a.resets
        for _ in range(10):
            with mem.phase("build_mask"):
                a.alloc(1)
                a.free(1)
    measured = (a.resets - resets0) // 2
    assert measured == 4  # occurrences 0, 1, 5, 9


# ---- profiler window ---------------------------------------------------------------------------------------------
def test_profile_window_torch_trace(tmp_path):
    win = ProfileWindow(kind="torch", start_step=2, stop_step=4, out_dir=tmp_path, name="w")
    for step in range(6):
        win.on_step(step)
        assert win.active == (2 <= step < 4)
        torch.ones(8) @ torch.ones(8)
    assert win.done and win.trace_path == tmp_path / "w.trace.json"
    assert "traceEvents" in json.loads(win.trace_path.read_text())
    assert win.summary is not None and win.summary["steps"] == 2  # CPU: no device kernels, said so
    assert win.summary["kernels"] == 0 and "no device kernels" in win.summary["note"]


def test_kernel_summary_busy_idle_and_ranking():
    # two steps; kernels 0-10 and 5-15 overlap (busy 15), a gap 15-20, then 20-30 (busy 10): window 30, busy 25
    ks = [("sm90_xmma_gemm_bf16", 0, 10), ("BatchDecodeWithPagedKVCacheKernel", 5, 15), ("_sandwich_kernel", 20, 30)]
    s = kernel_summary(ks, steps=2)
    assert s["kernels"] == 3 and s["kernels_per_step"] == 1.5
    assert s["window_ms"] == pytest.approx(0.030) and s["device_busy_ms"] == pytest.approx(0.025)
    assert s["busy_fraction"] == pytest.approx(25 / 30)
    assert s["idle_ms_per_step"] == pytest.approx(0.0025)
    assert s["by_kind_ms_per_step"] == pytest.approx({"gemm": 0.005, "attention": 0.005, "triton": 0.005})
    assert [t["kind"] for t in s["top"]] == ["gemm", "attention", "triton"]  # ties keep the sorted start order
    assert s["top"][0]["count"] == 1 and s["top"][0]["mean_us"] == pytest.approx(10.0)
    assert s["idle_gaps"] == pytest.approx(
        {"launch_gap_max_us": 5.0, "launch_gaps_per_step": 0.5, "launch_gap_ms_per_step": 0.0025,
         "host_gaps_per_step": 0.0, "host_gap_ms_per_step": 0.0, "longest_gap_us": 5.0}
    )  # fmt: skip


def test_kernel_summary_splits_idle_into_launch_and_host_gaps():
    """Back-to-back kernels 2 us apart (a graph's launch gaps) and one 400 us wait (the host): the idle time of
    the window splits at LAUNCH_GAP_MAX_US, and the two parts add up to idle_ms_per_step."""
    ks = [(f"k{i}", 12.0 * i, 12.0 * i + 10) for i in range(50)]  # 50 kernels of 10 us, 2 us gaps
    ks += [(f"k{i}", 1000.0 + 12.0 * i, 1000.0 + 12.0 * i + 10) for i in range(50)]  # after a 402 us gap
    s = kernel_summary(ks, steps=2)
    g = s["idle_gaps"]
    assert g["launch_gaps_per_step"] == 49 and g["launch_gap_ms_per_step"] == pytest.approx(0.098)
    assert g["host_gaps_per_step"] == 0.5 and g["host_gap_ms_per_step"] == pytest.approx(0.201)
    assert g["longest_gap_us"] == pytest.approx(402.0)
    assert g["launch_gap_ms_per_step"] + g["host_gap_ms_per_step"] == pytest.approx(s["idle_ms_per_step"])


def test_profile_window_cuda_kind_calls_profiler_api(tmp_path):
    calls = []
    fake_torch = SimpleNamespace(
        cuda=SimpleNamespace(
            is_available=lambda: True,
            synchronize=lambda: calls.append("sync"),
            profiler=SimpleNamespace(start=lambda: calls.append("start"), stop=lambda: calls.append("stop")),
        )
    )
    win = ProfileWindow(kind="cuda", start_step=1, stop_step=3, out_dir=tmp_path, torch_module=fake_torch)
    for step in range(2):
        win.on_step(step)
    assert calls == ["sync", "start"]
    win.close()  # scenario ended inside the window
    assert calls == ["sync", "start", "sync", "stop"]
    win.on_step(1)
    assert calls[-1] == "stop"  # a finished window never restarts


def test_profile_window_none_and_validation(tmp_path):
    win = ProfileWindow()
    win.on_step(0)
    assert not win.active and win.close() is None
    with pytest.raises(ValueError):
        ProfileWindow(kind="torch", start_step=3, stop_step=3, out_dir=tmp_path)
    with pytest.raises(ValueError):
        ProfileWindow(kind="nsys", start_step=0, stop_step=1)  # type: ignore[arg-type]


def test_profile_window_python_host_summary(tmp_path):
    def busy() -> int:
        return sum(i * i for i in range(20000))

    win = ProfileWindow(kind="python", start_step=1, stop_step=3, out_dir=tmp_path, name="h")
    for step in range(5):
        win.on_step(step)
        busy()
    win.close()
    assert win.trace_path == tmp_path / "h.pstats" and win.trace_path.exists()
    s = win.summary
    assert s["steps"] == 2 and s["host_ms_per_step"] > 0
    names = [t["function"] for t in s["top"]]
    assert any("busy" in n for n in names)
    row = next(t for t in s["top"] if "(busy)" in t["function"])
    assert row["calls_per_step"] == 1.0  # busy() ran twice inside the 2-step window


def test_kernel_kinds_of_our_triton_gemms():
    from perfkit.capture.profiler import kernel_kind

    assert kernel_kind("_moe_gather_gate_up_kernel") == "gemm"  # a GEMV over gathered experts, not a copy
    assert kernel_kind("_w4a16_gemv_kernel") == "gemm"
    assert kernel_kind("_sandwich_kernel") == "triton"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4>") == "copy"
