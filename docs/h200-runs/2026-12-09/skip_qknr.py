"""`python3 docs/h200-runs/2026-12-09/skip_qknr.py normal|skip <perfkit args>`: the perfkit CLI, as is (normal) or
with the q/k norm + RoPE + KV write launch left out of every one-token step (skip).

Why: an upper bound on what folding that launch into the decode kernel could save (docs/next-h200-session.md).
With skip, a one-token step's attention reads the raw q and never writes the new token's K/V, so its tokens are
wrong: only its timing means anything (the same kernels otherwise, and the fold would still do the norm work
inside the decode kernel, so the real gain is at most this). Steps of more than one token (the prefills) run the
real launch.
"""

import runpy
import sys

from perfkit.kernels import qk_norm_rope

if sys.argv[1] == "skip":
    real = qk_norm_rope.qkv_norm_rope_split

    def skip(q_raw, k_raw, v_raw, q_weight, k_weight, cos, sin, eps, kv_cache=None, pdl=False):
        if q_raw.shape[0] != 1:
            return real(q_raw, k_raw, v_raw, q_weight, k_weight, cos, sin, eps, kv_cache, pdl)
        return q_raw, None, None  # q_raw: a strided view of the qkv output, which the decode kernel accepts

    qk_norm_rope.qkv_norm_rope_split = skip  # before the model's kernel table binds it
elif sys.argv[1] != "normal":
    raise SystemExit("usage: skip_qknr.py normal|skip <perfkit args>")
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
