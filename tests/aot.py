"""Ahead-of-time Triton compiles for sm_90 in a subprocess, for tests that check what the compiler (not the CPU
interpreter, which accepts code the compiler refuses) makes of a kernel: no GPU needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def sm90_rows(script: str, *args: str) -> list:
    """Run ``script`` (python source that prints one JSON list as its last line) outside the interpreter and return
    that list; skip when this Triton build cannot assemble for sm_90 (a row holding a ptxas error)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    if any(isinstance(r, str) and "ptxas" in r.lower() for r in rows):
        pytest.skip(f"this Triton build cannot assemble for sm_90: {rows}")
    return rows
