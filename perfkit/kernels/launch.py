"""Facts the Triton kernels' launchers size their grids by, in one place: whether kernels run under the CPU
interpreter (``TRITON_INTERPRET=1``, which CI uses), how many SMs the device has (split-K and grid rules) and its
compute capability (which kernel forms it can run)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Triton kernels run under the CPU interpreter (read per call: tests set the variable before importing)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, cached (launchers ask per call); (0, 0) elsewhere."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (the CPU interpreter: split-K only for one-program grids, so the tests
    force it with an explicit split)."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
