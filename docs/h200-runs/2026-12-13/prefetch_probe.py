"""Can the FFN block's idle side branch prefetch the next layer's qkv weight into L2? (12-13, issue #9)

In a 26B-A4B MoE layer with ``decode_moe_ffn=branches`` the dense MLP (side stream, ~13 us) runs beside the
routed experts (~30 us); the side stream then idles while the next layer's qkv GEMV (8192 x 2816 bf16, 46 MB) waits
behind the join to stream its weight. ``l2_prefetch`` (below) asks for a weight's first bytes into L2: one
``cp.async.bulk.prefetch.L2`` per span, tagged evict_last so the experts' streaming reads do not push them out.
Each link here is [swr (sandwich + router) -> fork: side dense MLP, main routing + experts -> join -> post
sandwich -> the next layer's qkv GEMV], LAYERS distinct weight sets, batch 1, bf16, PDL on.

Arms (us per link, median of REPLAYS graph replays of LINKS links):
  branch          no prefetch (the engine today)
  after_<MB>      side stream: dense MLP, then prefetch <MB> of the next layer's qkv weight (evict_last)
  after_<MB>_n    the same without the evict_last hint
  first_<MB>      side stream: prefetch first, then the dense MLP
  serial_pf_<MB>  the prefetch on the main stream after the experts (what the overlap buys)
  ..._c<KB>k      spans of KB KiB per bulk prefetch instead of 64 (more programs: call 1's 64 KiB spans ran on 2-8
                  SMs' copy engines)
Call 1 (64 KiB spans) also ran after_8 / 24 / 32, after_16_n (no evict_last hint) and first_16 (prefetch before the
dense MLP): every arm was slower than branch (1-prefetch.jsonl).
Each arm's qkv output is compared with the branch arm's (a prefetch must change nothing).
Run on the device: python3 docs/h200-runs/2026-12-13/prefetch_probe.py > $OUT/prefetch.jsonl
"""

import json
import statistics

import torch
import triton
import triton.language as tl

from perfkit.kernels import moe
from perfkit.kernels.gemv import default_tile, gemv
from perfkit.kernels.launch import interpreting
from perfkit.kernels.rmsnorm import sandwich_rmsnorm

# The prefetch kernel (perfkit/kernels/l2_prefetch.py while it was measured; removed after call 2: no arm won).
CHUNK_BYTES = 64 * 1024  # one bulk prefetch per thread and span (a multiple of 16)
THREADS = 32  # one warp per program


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Thread i of program p: the span [CHUNK * (32 p + i), +CHUNK) clipped to nbytes, as one bulk L2 prefetch."""
    off = (tl.program_id(0) * 32 + tl.arange(0, 32)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
    size = tl.where(size > 0, size, 0)
    addr = ptr + off
    if EVICT_LAST:  # (a str variable cannot cross a Triton if: one call per branch)
        tl.inline_asm_elementwise(
            """{ .reg .b64 pol; .reg .pred p;
            setp.gt.s32 p, $2, 0;
            createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
            @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
            mov.b32 $0, 0; }""",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            """{ .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.b32 $0, 0; }""",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def prefetch_supported(t: torch.Tensor) -> bool:
    """Whether ``l2_prefetch`` issues anything for ``t``: a CUDA tensor on sm_90+, kernels compiled (not
    interpreted), and its storage 16-byte aligned (the bulk prefetch's rule)."""
    if not t.is_cuda or interpreting() or t.data_ptr() % 16:
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def l2_prefetch(t: torch.Tensor, nbytes: int, evict_last: bool = True, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Ask for the first ``nbytes`` of ``t``'s storage (contiguous) into L2; returns at once (stream-ordered like any
    launch, CUDA-graph safe). A no-op where ``prefetch_supported`` is False or ``nbytes`` <= 0. ``chunk_bytes``
    (a multiple of 16): the span of one bulk prefetch; 32 spans per program."""
    nbytes = min(int(nbytes), t.numel() * t.element_size()) // 16 * 16
    if nbytes <= 0 or not prefetch_supported(t):
        return
    raw = t.view(-1).view(torch.uint8)
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    programs = triton.cdiv(triton.cdiv(nbytes, chunk_bytes), THREADS)
    _l2_prefetch_kernel[(programs,)](raw, nbytes, CHUNK=chunk_bytes, EVICT_LAST=evict_last, num_warps=1)


H, I_D, E, I_E, K, QKV = 2816, 2112, 128, 704, 8, 8192
LAYERS, LINKS, REPLAYS = 8, 32, 20


def layer_weights(gen):
    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(torch.bfloat16)

    return {
        "w_gu": rnd(2 * I_D, H), "w_dn": rnd(H, I_D), "w_r": rnd(E, H, s=0.05), "e_gu": rnd(E, 2 * I_E, H),
        "e_dn": rnd(E, H, I_E), "scale": torch.rand(E, device="cuda", generator=gen) + 0.5,
        "w_qkv": rnd(QKV, H), "norms": [rnd(H, s=1.0) for _ in range(7)],
    }  # fmt: skip


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [layer_weights(gen) for _ in range(LAYERS)]
    a = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    scalar = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    t_gu, t_dn, t_qkv, root = default_tile(2 * I_D, H), default_tile(H, I_D), default_tile(QKV, H), H**-0.5
    side = torch.cuda.Stream()
    pdl = True

    def swr(L):
        n = L["norms"]
        return sandwich_rmsnorm(a, res, n[0], 1e-6, next_weights=n[1:3], router=(L["w_r"], n[3], root), pdl=pdl)[1]

    def sw_post(L, m, e):
        n = L["norms"]
        return sandwich_rmsnorm(m, res, n[4], 1e-6, x2=(e, n[5], n[6]), scalar=scalar, next_weights=[n[1]], pdl=pdl)

    def dense(L, y):
        return gemv(gemv(y, L["w_gu"], t_gu, pdl=pdl), L["w_dn"], t_dn, pdl=pdl, glu=True)

    def experts(L, y, logits):
        rw, ridx = moe.moe_routing(logits, K, L["scale"], pdl=pdl)
        return moe.fused_moe(y, L["e_gu"], L["e_dn"], rw, ridx, path="gather", pdl=pdl)

    def link(i, mb=0.0, where="after", evict_last=True, chunk=64 * 1024):
        L, nxt = layers[i % LAYERS], layers[(i + 1) % LAYERS]
        nbytes = int(mb * 1e6)
        ys = swr(L)
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            if where == "first":
                l2_prefetch(nxt["w_qkv"], nbytes, evict_last, chunk)
            m = dense(L, ys[0])
            if where == "after":
                l2_prefetch(nxt["w_qkv"], nbytes, evict_last, chunk)
        e = experts(L, ys[1], ys[2])
        if where == "serial":
            l2_prefetch(nxt["w_qkv"], nbytes, evict_last, chunk)
        main_s.wait_stream(side)
        y_next = sw_post(L, m, e)[1][0]
        return gemv(y_next, nxt["w_qkv"], t_qkv, pdl=pdl)

    arms = {"branch": {}}
    for mb in (4, 16):
        arms[f"after_{mb}"] = {"mb": mb}
        for kb in (8, 2):
            arms[f"after_{mb}_c{kb}k"] = {"mb": mb, "chunk": kb * 1024}
    arms["serial_pf_16"] = {"mb": 16, "where": "serial"}
    arms["serial_pf_16_c2k"] = {"mb": 16, "where": "serial", "chunk": 2048}
    q0 = link(0)
    torch.cuda.synchronize()
    for name, kw in arms.items():
        q1 = link(0, **kw)
        torch.cuda.synchronize()
        print(json.dumps({"check": name, "qkv_max_abs": (q1.float() - q0.float()).abs().max().item()}), flush=True)
    graphs = {}
    for name, kw in arms.items():

        def chain(kw=kw):
            for i in range(LINKS):
                link(i, **kw)

        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            graphs[name] = g
        except Exception as exc:
            print(json.dumps({"arm": name, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
    times = {k: [] for k in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        for k, g in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times[k].append(start.elapsed_time(stop) * 1e3 / LINKS)
    for name, ts in times.items():
        print(json.dumps({"arm": name, "us_per_link": round(statistics.median(ts), 3), "min": round(min(ts), 3),
                          "max": round(max(ts), 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
