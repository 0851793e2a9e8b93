"""perfkit: benchmarking and profiling toolkit for Gemma4 serving on NVIDIA GPUs."""

__version__ = "0.1.0"
