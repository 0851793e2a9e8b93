"""Session-wide test setup shared by every test module."""

import os

import torch


def pytest_configure(config) -> None:
    """Without CUDA the Triton kernels run under the interpreter, which triton reads from TRITON_INTERPRET when
    it is imported; pytest calls this hook before it imports any test module, so it is set once here rather
    than at the top of every module that touches a kernel."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
