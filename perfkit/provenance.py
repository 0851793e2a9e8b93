"""Where a number came from: perfkit checkout, packages, and the GPU it ran on.

Recorded in every result so `perfkit compare` can warn when A and B are not comparable (another GPU, driver,
package version or a dirty tree). Works on a CPU-only machine: the GPU section then says there is none.
GPU facts come from nvidia-ml-py (NVML) and torch.cuda; each probe is guarded so a missing library or driver
yields `available: false` with the reason rather than an exception.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("perfkit", "torch", "triton", "flashinfer-python", "transformers", "numpy", "nvidia-ml-py", "nvtx")


def git_info(root: Path | None = None) -> dict[str, Any]:
    """sha and dirty flag of the perfkit checkout (None when perfkit is not run from a git checkout)."""
    root = root or Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    # a copy of the tree (a container, a remote GPU machine) may have no .git, or a stale one that does not
    # match the files: the launcher that made the copy passes the commit along, and it wins
    env_sha = os.environ.get("PERFKIT_GIT_SHA")
    if env_sha:
        return {"sha": env_sha, "short": env_sha[:10], "dirty": os.environ.get("PERFKIT_GIT_DIRTY") == "1",
                "source": "PERFKIT_GIT_SHA"}  # fmt: skip
    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "short": sha[:10], "dirty": bool(status)}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _torch_cuda() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch_cuda": None, "cuda_available": False}
    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "cuda_available": bool(torch.cuda.is_available())}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_count=torch.cuda.device_count(),
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            total_memory_bytes=int(props.total_memory),
        )
    return info


def _nvml(nvml: Any = None) -> dict[str, Any]:
    """Driver, GPU name, memory, clocks and power limit of device 0 through NVML."""
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - library or driver absent: say so
        return {"nvml": False, "nvml_reason": f"NVML unavailable: {type(err).__name__}: {err}".strip()}
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)

        def get(fn: str, *args: Any) -> Any:
            try:
                value = getattr(nvml, fn)(*args)
                return value.decode() if isinstance(value, bytes) else value
            except Exception:  # noqa: BLE001 - a field this GPU or driver does not report
                return None

        mem = get("nvmlDeviceGetMemoryInfo", h)
        power_mw = get("nvmlDeviceGetPowerManagementLimit", h)
        cuda_drv = get("nvmlSystemGetCudaDriverVersion")
        return {
            "nvml": True,
            "name": get("nvmlDeviceGetName", h),
            "driver": get("nvmlSystemGetDriverVersion"),
            "cuda_driver": f"{cuda_drv // 1000}.{(cuda_drv % 1000) // 10}" if isinstance(cuda_drv, int) else None,
            "memory_total_bytes": int(mem.total) if mem is not None else None,
            "sm_clock_max_mhz": get("nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM),
            "mem_clock_max_mhz": get("nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_MEM),
            "sm_clock_mhz": get("nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM),
            "power_limit_w": power_mw / 1000 if isinstance(power_mw, (int, float)) else None,
            "persistence_mode": get("nvmlDeviceGetPersistenceMode", h),
        }
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def gpu_info(nvml: Any = None) -> dict[str, Any]:
    """GPU section: `available: false` and a reason on a machine without a CUDA GPU."""
    tc = _torch_cuda()
    if not tc["cuda_available"]:
        return {"available": False, "reason": "no CUDA GPU visible to torch", "torch_cuda": tc["torch_cuda"]}
    info = {"available": True, **tc, **_nvml(nvml)}
    if not info.get("name"):
        import torch

        info["name"] = torch.cuda.get_device_name(0)
    return info


def collect(nvml: Any = None) -> dict[str, Any]:
    """Everything a result records about where it ran."""
    return {
        "git": git_info(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "argv": sys.argv,
        "packages": package_versions(),
        "gpu": gpu_info(nvml),
    }
