"""For the next session (not run yet): the decode prologue's cost per layer with the gemvs around it, as in the
engine's batch-1 step. 12-10's `prologue_probe.py` chained attention launches only and predicted a gain where the
engine measured a loss; the suspect is PDL: a kernel launches as soon as every program of the one before has
started and then waits resident, so the fused decode kernel's many programs sit beside the qkv gemv while it
streams its weight (in the separate path only the small qkv_norm_rope kernel does).

Each link of a CUDA graph of 30 (prologue_probe's graph_of and timing): [qkv gemv] -> ([qkv_norm_rope] -> decode + merge | decode with the prologue + merge)
-> [o_proj gemv], at batch 1, kv length ~1,100, bf16, perfkit's gemv with its default tiles. Arms per shape:
`separate` / `fused` / `gemvs` (the two gemvs alone), each with PDL on and off. One JSON line per (shape, pdl, arm)
with the median us per link.

Run on the device: python3 docs/h200-runs/2026-12-10/prologue_gemv_probe.py > $OUT/gemv_probe.jsonl
On a CPU (TRITON_INTERPRET=1): python3 docs/h200-runs/2026-12-10/prologue_gemv_probe.py --check (each arm once,
tiny shapes, outputs of the two arms compared).
"""

import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from prologue_probe import graph_of, median_us_per_link  # noqa: E402
from test_paged_decode import prologue_case  # noqa: E402

from perfkit.kernels.gemv import default_tile, gemv  # noqa: E402
from perfkit.kernels.paged_decode import paged_decode_attention, pick_splits  # noqa: E402
from perfkit.kernels.qk_norm_rope import qkv_norm_rope_split  # noqa: E402

SHAPES = {  # heads, kv heads, head_dim, window, kind, hidden
    "26b-sliding": (16, 8, 256, 1024, "kv", 2816), "26b-full": (16, 2, 512, None, "k=v", 2816),
    "31b-sliding": (32, 16, 256, 1024, "kv", 5376), "31b-full": (32, 4, 512, None, "k=v", 5376),
}  # fmt: skip


def links(q_raw, cache, ind, ptr, kl, pro, window, splits, hidden, pdl):
    """The arms' link functions; q / k / v are views of the qkv gemv's output, as in the engine."""
    B, nh, hd = q_raw.shape
    kvh = pro.k_raw.shape[1]
    width = (nh + kvh * (1 if pro.v_raw is None else 2)) * hd
    g = torch.Generator().manual_seed(0)
    dev, dt = q_raw.device, q_raw.dtype
    w_qkv = (torch.randn(width, hidden, generator=g) * 0.02).to(dt).to(dev)
    w_o = (torch.randn(hidden, nh * hd, generator=g) * 0.02).to(dt).to(dev)
    x = torch.randn(B, hidden, generator=g).to(dt).to(dev)
    qkv = torch.empty(B, width, dtype=dt, device=dev)
    o = torch.empty(B, hidden, dtype=dt, device=dev)
    q = qkv[:, : nh * hd].view(B, nh, hd)
    k = qkv[:, nh * hd : (nh + kvh) * hd].view(B, kvh, hd)
    v = None if pro.v_raw is None else qkv[:, (nh + kvh) * hd :].view(B, kvh, hd)
    pro = pro._replace(k_raw=k, v_raw=v)
    t_qkv, t_o = default_tile(width, hidden), default_tile(hidden, nh * hd)
    attn = torch.empty(B, nh, hd, dtype=dt, device=dev)
    kw = dict(window=window, num_splits=splits, pdl=pdl)
    target = (cache, pro.slot_page, pro.slot_offset)

    def gemvs():
        gemv(x, w_qkv, t_qkv, out=qkv, pdl=pdl)
        gemv(attn.view(B, -1), w_o, t_o, out=o, pdl=pdl)

    def separate():
        gemv(x, w_qkv, t_qkv, out=qkv, pdl=pdl)
        qn = qkv_norm_rope_split(q, k, v, pro.q_weight, pro.k_weight, pro.cos, pro.sin, pro.eps, target, pdl=pdl)[0]
        paged_decode_attention(qn, cache, ind, ptr, kl, out=attn, **kw)
        gemv(attn.view(B, -1), w_o, t_o, out=o, pdl=pdl)

    def fused():
        gemv(x, w_qkv, t_qkv, out=qkv, pdl=pdl)
        paged_decode_attention(q, cache, ind, ptr, kl, out=attn, prologue=pro, **kw)
        gemv(attn.view(B, -1), w_o, t_o, out=o, pdl=pdl)

    return {"gemvs": gemvs, "separate": separate, "fused": fused}, o


def main():
    from perfkit.kernels.launch import sm_count

    sms = sm_count(torch.device("cuda"))
    for name, (heads, kvh, hd, window, kind, hidden) in SHAPES.items():
        for pdl in (True, False):
            q_raw, cache, ind, ptr, kl, pro = prologue_case([1100], heads, kvh, hd, 16, kind, seed=1, device="cuda")
            fns, _ = links(q_raw, cache, ind, ptr, kl, pro, window, pick_splits(1, kvh, sms, window), hidden, pdl)
            for a, us in median_us_per_link({a: graph_of(f) for a, f in fns.items()}).items():
                print(json.dumps({"shape": name, "pdl": pdl, "arm": a, "us_per_link": us}), flush=True)


def check():
    """CPU interpreter: both arms once at a tiny shape; the fused arm's o_proj output equals the separate arm's."""
    outs = []
    for arm in ("separate", "fused"):
        q_raw, cache, ind, ptr, kl, pro = prologue_case([37], 4, 2, 64, 16, "kv", seed=3)
        fns, o = links(q_raw, cache, ind, ptr, kl, pro, None, 3, 64, False)
        fns["gemvs"]()
        fns[arm]()
        outs.append(o.clone())
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
    print("check ok")


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
