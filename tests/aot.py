"""Ahead-of-time Triton compiles for sm_90 in a subprocess, for tests that check what the compiler (not the CPU
interpreter, which accepts code the compiler refuses) makes of a kernel: no GPU needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Defined for every script: ``resource_usage(kernel)`` -> (registers, stack bytes) of a compiled kernel's cubin, read
# with the cuobjdump Triton ships (a kernel compiled ahead of time has no n_regs / n_spills: those come with loading);
# ``sm90_compile(fn, signature, constexprs, num_warps)`` -> the kernel compiled for sm_90.
_PRELUDE = """
def resource_usage(kernel):
    import os, re, subprocess, tempfile
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return tuple(int(re.search(p, usage).group(1)) for p in (r"REG:(\\d+)", r"STACK:(\\d+)"))

def sm90_compile(fn, sig, consts, warps):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    s = sig | dict.fromkeys(consts, "constexpr")  # ASTSource applies no defaults: every constexpr given
    return triton.compile(ASTSource(fn, s, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
"""


def sm90_rows(script: str, *args: str) -> list:
    """Run ``script`` (python source that prints one JSON list as its last line; ``resource_usage`` is defined for it)
    outside the interpreter and return that list; skip when this Triton build cannot assemble for sm_90 (a row
    holding a ptxas error)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + script, *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    if any(isinstance(r, str) and "ptxas" in r.lower() for r in rows):
        pytest.skip(f"this Triton build cannot assemble for sm_90: {rows}")
    return rows
