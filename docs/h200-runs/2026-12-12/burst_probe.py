"""Do the batch-1 decode's small weight streams lose their bandwidth to too few bytes in flight? (12-12 call 1)

26B-A4B's per-layer products read 12-63 MB each and run at 2.4-3.6 TB/s (12-07 gemv sweep, 12-11 ffn_probe)
while the 1.5 GB LM head runs at 4.45. Each of their programs keeps one or two weight tiles in flight (8-16 KB),
and with 2-5 programs per SM an SM has ~40 KB outstanding: by Little's law (4.3 TB/s x ~1.5 us loaded latency /
132 SMs ~ 50 KB per SM) that is just short of enough, and each program's rows then take several dependent round
trips. "Burst" tiles load a program's whole row block in one masked step (BLOCK_K >= K: no loop step, only the
tail), so every byte of the product is requested at once. No kernel change: the existing kernels with such tiles.

Sections (one JSON line per row, to stdout):
  gemv    time_gemv_choice (PDL, each call after an rmsnorm, 20 calls over distinct weights) at the 26B-A4B decode
          shapes, GEMV_TILES + the preload-2 candidates + burst tiles; the down shape with its GLU form too.
  gather  CUDA graphs of 32 links over 8 layers' expert weights (fixed routing, batch 1, PDL): the gather gate_up
          and down kernels, default tile against burst tiles.
  stream  the load-only ceiling at each size: one launch with L2 flushed (stream_read_ms) and a back-to-back chain
          over distinct buffers (graph_sequence_us), the way the step's kernels follow each other.
Run on the device: python3 docs/h200-runs/2026-12-12/burst_probe.py [gemv gather stream] > $OUT/burst.jsonl
"""

import json
import statistics
import sys

import torch
import triton

from perfkit.kernels import moe
from perfkit.kernels.gemv import GEMV_PRELOAD_CANDIDATES, GEMV_TILES, GemvConfig, time_gemv_choice
from perfkit.kernels.stream import STREAM_CONFIGS, stream_fold, stream_read_ms
from perfkit.kernels.timing import graph_sequence_us

H, I_E, E, K = 2816, 704, 128, 8
SHAPES = {"down": (2816, 2112), "gate_up": (4224, 2816), "o_sliding": (2816, 4096), "o_full": (2816, 8192),
          "qkv_sliding": (8192, 2816), "qkv_full": (9216, 2816)}  # fmt: skip
BURST_NW = ((1, 2), (1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8))
LAYERS, LINKS, REPLAYS = 8, 32, 20


def emit(row):
    print(json.dumps(row), flush=True)


def gemv_section():
    for name, (N, K_) in SHAPES.items():
        bk = triton.next_power_of_2(K_)
        burst = tuple(GemvConfig(n, bk, w) for n, w in BURST_NW if n * bk // (32 * w) <= 128)
        copies = max(2, min(20, -(-200_000_000 // (2 * N * K_))))
        ws = [torch.randn(N, K_, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        tiles = GEMV_TILES + GEMV_PRELOAD_CANDIDATES + burst
        emit({"section": "gemv", "shape": name, **time_gemv_choice(ws, tiles, pdl=True, glu=name == "down")})
        del ws
        torch.cuda.empty_cache()


def gather_section():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    e_gu = [rnd(E, 2 * I_E, H) for _ in range(LAYERS)]
    e_dn = [rnd(E, H, I_E) for _ in range(LAYERS)]
    x = rnd(1, H) * 50
    rw, ridx = moe.moe_routing(torch.randn(1, E, device="cuda", generator=gen), K, torch.ones(E, device="cuda"))
    idx, topw = ridx.reshape(-1).contiguous(), rw.reshape(-1).contiguous()
    act = rnd(K, I_E) * 50
    gu_default = moe._gather_tiles(moe.gather_gate_up_defaults(K), None, I_E, H)
    dn_default = moe._gather_tiles(moe.GATHER_DOWN_TILES, None, H, I_E)
    burst = lambda n, k, w: {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "PREFETCH": 1, "EVICT_FIRST": 1}  # noqa: E731
    arms = {"gu_default": ("gu", gu_default), "dn_default": ("dn", dn_default)}
    for n, w in ((1, 2), (1, 4), (2, 4), (4, 4), (4, 8)):
        arms[f"gu_burst_{n}x4096w{w}"] = ("gu", moe._gather_tiles(burst(n, 4096, w), None, I_E, H))
    for n, w in ((1, 2), (1, 4), (2, 4), (2, 8), (4, 8)):
        arms[f"dn_burst_{n}x1024w{w}"] = ("dn", moe._gather_tiles(burst(n, 1024, w), None, H, I_E))
    ref = {"gu": moe._gather_gate_up(x, e_gu[0], idx, topw, K, gu_default), "dn": None}
    ref["dn"] = moe._gather_down(act, e_dn[0], idx, topw, K, dn_default, torch.bfloat16)
    graphs = {}
    for name, (kind, t) in arms.items():
        def call(i, kind=kind, t=t):
            if kind == "gu":
                return moe._gather_gate_up(x, e_gu[i], idx, topw, K, t, True)
            return moe._gather_down(act, e_dn[i], idx, topw, K, t, torch.bfloat16, True)

        try:
            err = (call(0).float() - ref[kind].float()).abs().max().item()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(LINKS):
                    call(i % LAYERS)
            graphs[name] = (g, err)
        except Exception as exc:  # a tile that does not compile here
            emit({"section": "gather", "arm": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    times = {k: [] for k in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        for k, (g, _) in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times[k].append(start.elapsed_time(stop) * 1e3 / LINKS)
    for k, ts in times.items():
        mb = (2 * 2 * I_E * H if k.startswith("gu") else 2 * H * I_E) * K / 1e6
        us = statistics.median(ts)
        emit({"section": "gather", "arm": k, "us_per_call": round(us, 3), "mb": round(mb, 1),
              "tb_s": round(mb / us, 3), "max_abs_diff_vs_default": graphs[k][1]})  # fmt: skip


def stream_section():
    for mb in (11.9, 23.1, 23.8, 31.7, 46.1, 51.9, 63.4, 87.2, 1476.4):
        row = {"section": "stream", "mb": mb, **stream_read_ms(int(mb * 1e6))}
        n = int(mb * 1e6) // 4
        copies = max(2, min(20, -(-400_000_000 // (4 * n))))
        bufs = [torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        chain = {}
        for cfg in STREAM_CONFIGS:
            chain[f"{cfg.num_warps}w_u{cfg.unroll}_p{cfg.programs_per_sm}"] = round(
                graph_sequence_us(lambda b, c=cfg: stream_fold(b, c), bufs, 20, 15), 2)
        best = min(chain.values())
        row |= {"chain_us": chain, "chain_best_us": best, "chain_tb_s": round(mb / best, 3)}
        emit(row)
        del bufs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    todo = sys.argv[1:] or ["gemv", "gather", "stream"]
    for s in todo:
        {"gemv": gemv_section, "gather": gather_section, "stream": stream_section}[s]()
