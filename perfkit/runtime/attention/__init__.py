"""Attention backends for the bundled Gemma4 runtime (interface in base.py, see docs/contracts.md)."""

from perfkit.runtime.attention.base import AttentionBackend, AttnLayer

__all__ = ["AttentionBackend", "AttnLayer"]
