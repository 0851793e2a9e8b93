"""12-10: what the decode prologue costs inside the Triton decode kernel, per launch pair, at the engine's pool
shapes (31B / 26B-A4B, sliding / full, batch 1 and 4, kv length ~1100), bf16, PDL on, CUDA-graph replays of 30
links (a step's layers). Arms, interleaved: `separate` (the qkv_norm_rope launch writing K/V into the cache, then the
kernel), `fused` (the kernel with the prologue as committed), `fused_where` (12-10 call 1's form: every program makes
the new row before its loop, a select inside the loop; `old_paged_decode.py` = af8ceb9), `q_only` (the prologue
without the new rows: what the q part costs), `plain` (the kernel alone on a ready q: the floor), `separate_old` /
`plain_old` (af8ceb9's kernel, whose loop was not yet split into a first block loaded before q and the rest). One
JSON line per (shape, batch, arm) with the median us per link over the replays. Call 2 ran it on 2b07abe (the new
row made before the loop by every program, its last block peeled), without the two _old arms.

Run on the device: python3 docs/h200-runs/2026-12-10/prologue_probe.py > $OUT/probe.jsonl
(After the runs, its timing loop moved into `median_us_per_link` unchanged, for prologue_gemv_probe.py to share.)
"""

import importlib.util
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))
from test_paged_decode import prologue_case  # noqa: E402

from perfkit.kernels.launch import sm_count  # noqa: E402
from perfkit.kernels.paged_decode import paged_decode_attention, pick_splits  # noqa: E402
from perfkit.kernels.qk_norm_rope import qkv_norm_rope_split  # noqa: E402

spec = importlib.util.spec_from_file_location("old_pd", pathlib.Path(__file__).with_name("old_paged_decode.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

SHAPES = {"31b-sliding": (32, 16, 256, 1024, "kv"), "31b-full": (32, 4, 512, None, "k=v"),
          "26b-sliding": (16, 8, 256, 1024, "kv"), "26b-full": (16, 2, 512, None, "k=v")}  # fmt: skip
LINKS, REPLAYS = 30, 25


def arms(q_raw, cache, ind, ptr, kl, pro, window, splits):
    kw = dict(window=window, num_splits=splits, pdl=True)
    q_ready = qkv_norm_rope_split(q_raw, pro.k_raw, pro.v_raw, pro.q_weight, pro.k_weight, pro.cos, pro.sin,
                                  pro.eps, (cache, pro.slot_page, pro.slot_offset))[0]  # fmt: skip
    out = torch.empty_like(q_ready)

    def separate(kernel=paged_decode_attention):
        q = qkv_norm_rope_split(q_raw, pro.k_raw, pro.v_raw, pro.q_weight, pro.k_weight, pro.cos, pro.sin, pro.eps,
                                (cache, pro.slot_page, pro.slot_offset), pdl=True)[0]  # fmt: skip
        kernel(q, cache, ind, ptr, kl, out=out, **kw)

    return {
        "separate": separate,
        "separate_old": lambda: separate(old.paged_decode_attention),
        "plain_old": lambda: old.paged_decode_attention(q_ready, cache, ind, ptr, kl, out=out, **kw),
        "fused": lambda: paged_decode_attention(q_raw, cache, ind, ptr, kl, out=out, prologue=pro, **kw),
        "fused_where": lambda: old.paged_decode_attention(q_raw, cache, ind, ptr, kl, out=out, prologue=pro, **kw),
        "q_only": lambda: paged_decode_attention(q_raw, cache, ind, ptr, kl, out=out, prologue=pro._replace(k_raw=None),
                                                 **kw),  # fmt: skip
        "plain": lambda: paged_decode_attention(q_ready, cache, ind, ptr, kl, out=out, **kw),
    }


def graph_of(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LINKS):
            fn()
    return g


def median_us_per_link(graphs: dict) -> dict:
    """Each graph replayed REPLAYS times, the arms interleaved; the median us per link of each."""
    times = {a: [] for a in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        for a, g in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times[a].append(start.elapsed_time(stop) * 1e3 / LINKS)
    return {a: round(statistics.median(ts), 3) for a, ts in times.items()}


def main():
    sms = sm_count(torch.device("cuda"))
    for name, (heads, kvh, hd, window, kind) in SHAPES.items():
        for bs in (1, 4):
            lens = [1100 + 37 * i for i in range(bs)]
            q_raw, cache, ind, ptr, kl, pro = prologue_case(lens, heads, kvh, hd, 16, kind, seed=bs, device="cuda")
            splits = pick_splits(bs, kvh, sms, window)
            graphs = {a: graph_of(f) for a, f in arms(q_raw, cache, ind, ptr, kl, pro, window, splits).items()}
            for a, us in median_us_per_link(graphs).items():
                print(json.dumps({"shape": name, "batch": bs, "splits": splits, "arm": a, "us_per_link": us}),
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
