"""Toggle decode_moe_ffn: a 26B-A4B MoE layer's feed-forward block at batch 1 in two launches after the attention
sandwich, which carries the router's product (perfkit/kernels/moe_ffn.py, sandwich_rmsnorm(router=)).

CPU (TRITON_INTERPRET=1): both kernels against the fp32 reference, the experts' output equal to the gather path's
bit for bit given the same routing, the routing equal to moe_routing's, the sandwich's router logits against the
separate sandwich + product, the traffic formulas, input checks, an sm_90 AOT compile of every variant; the model's
launches (spies), its logits against the separate path's, the fallbacks, and the engine toggle. GPU: real 26B-A4B
shapes in a CUDA graph with PDL against the separate launches, and the engine's greedy tokens with the toggle on
and off on a real-width 2-layer 26B-A4B.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("triton")

from test_decode_fusion import _forward, _model  # noqa: E402
from test_decode_fusion import _Spy as _FusionSpy  # noqa: E402

from perfkit.config import PartialToggles, Toggles  # noqa: E402
from perfkit.kernels import moe  # noqa: E402
from perfkit.kernels.moe_ffn import moe_ffn, moe_ffn_ref, moe_ffn_traffic  # noqa: E402
from perfkit.kernels.rmsnorm import sandwich_rmsnorm, sandwich_rmsnorm_ref, sandwich_rmsnorm_traffic  # noqa: E402
from perfkit.runtime.engine import TOGGLES, Engine, EngineConfig  # noqa: E402
from perfkit.runtime.model_config import get_preset  # noqa: E402
from perfkit.runtime.weights import build_model  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _block(H=96, I_d=80, I_e=40, E=16, dtype=torch.float32, seed=0, device="cpu"):
    """A MoE FFN block's operands: x, x2, logits, dense gate_up / down, experts' gate_up / down, per_expert_scale."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=0.1):
        return (torch.randn(*shape, generator=g) * s).to(dtype).to(device)

    scale = (torch.rand(E, generator=g) + 0.5).to(device)
    return (rnd(1, H, s=1.0), rnd(1, H, s=1.0), rnd(1, E, s=1.0), rnd(2 * I_d, H), rnd(H, I_d), rnd(E, 2 * I_e, H),
            rnd(E, H, I_e), scale)  # fmt: skip


@pytest.mark.parametrize("top_k", [1, 4, 8])
def test_moe_ffn_is_the_reference_and_the_gather_path(top_k):
    """fp32: both outputs equal the fp32 reference to rounding; the experts' output equals fused_moe's gather path
    bit for bit on moe_routing's routing (the same per-program bodies, the same routing code)."""
    x, x2, logits, wgu, wd, egu, ed, scale = _block()
    m, e = moe_ffn(x, x2, logits, wgu, wd, egu, ed, top_k, scale)
    m_ref, e_ref = moe_ffn_ref(x, x2, logits, wgu, wd, egu, ed, top_k, scale)
    torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e, e_ref, rtol=1e-5, atol=1e-5)
    w, idx = moe.moe_routing(logits, top_k, scale)
    assert torch.equal(e, moe.fused_moe(x2, egu, ed, w, idx, path="gather"))
    m2, e2 = moe_ffn(x, x2, logits * 0, wgu, wd, egu, ed, top_k, scale, routing=(w, idx))  # routed before: read
    assert torch.equal(m2, m) and torch.equal(e2, e)


def test_moe_ffn_bf16_and_odd_widths():
    """bf16 operands, widths that are not multiples of the tiles (the masked tails, the rows past the end)."""
    ops = _block(H=300, I_d=50, I_e=21, E=10, dtype=torch.bfloat16, seed=3)
    m, e = moe_ffn(*ops[:7], 4, ops[7])
    m_ref, e_ref = moe_ffn_ref(*ops[:7], 4, ops[7])
    assert m.dtype == e.dtype == torch.bfloat16
    torch.testing.assert_close(m.float(), m_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(e.float(), e_ref.float(), rtol=2e-2, atol=2e-2)


def test_moe_ffn_rejects_what_it_cannot_run():
    x, x2, logits, wgu, wd, egu, ed, scale = _block()
    with pytest.raises(ValueError, match="power-of-2 top_k"):
        moe_ffn(x, x2, logits, wgu, wd, egu, ed, 3, scale)
    with pytest.raises(ValueError, match="one row"):
        moe_ffn(torch.cat([x, x]), x2, logits, wgu, wd, egu, ed, 4, scale)
    with pytest.raises(ValueError, match="one row"):
        moe_ffn(x, x2, logits, wgu.to(torch.bfloat16), wd, egu, ed, 4, scale)
    with pytest.raises(ValueError, match="x2"):
        moe_ffn(x, x2[:, :5], logits, wgu, wd, egu, ed, 4, scale)


def test_moe_ffn_traffic_reads_every_weight_once():
    t = moe_ffn_traffic(2816, 2112, 704, 8)
    weights = 3 * 2112 * 2816 + 8 * 3 * 704 * 2816
    assert t["weight_bytes"] == 2 * weights and t["flops"] == 2 * weights
    assert t["bytes"] == t["weight_bytes"] + t["activation_bytes"]
    assert t["activation_bytes"] == 2 * (4 * 2816 + 2 * 2112 + 2 * 8 * 704)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sandwich_router_logits(dtype):
    """The sandwich's outputs are unchanged by the router's programs; its logits equal the separate sandwich's
    router pre-norm output times the router weight, accumulated in fp32 (one rounding apart in bf16) and the
    reference's."""
    g = torch.Generator().manual_seed(1)
    R, N, E = 2, 200, 10
    x, res = torch.randn(R, N, generator=g).to(dtype), torch.randn(R, N, generator=g).to(dtype)
    w, rn = torch.rand(N, generator=g).to(dtype), torch.rand(N, generator=g).to(dtype)
    nw = [torch.rand(N, generator=g).to(dtype) for _ in range(2)]
    proj = torch.randn(E, N, generator=g).to(dtype)
    h, ys = sandwich_rmsnorm(x, res, w, 1e-6, next_weights=nw, next_mults=[1.0, 0.5], router=(proj, rn, 0.3))
    h0, ys0 = sandwich_rmsnorm(x, res, w, 1e-6, next_weights=[*nw, rn], next_mults=[1.0, 0.5, 0.3])
    assert len(ys) == 3 and ys[2].shape == (R, E) and ys[2].dtype == dtype
    assert torch.equal(h, h0) and torch.equal(ys[0], ys0[0]) and torch.equal(ys[1], ys0[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    logits = (ys0[2].float() @ proj.float().T).to(dtype)
    torch.testing.assert_close(ys[2].float(), logits.float(), rtol=tol, atol=tol)
    _, ref = sandwich_rmsnorm_ref(x, res, w, 1e-6, next_weights=nw, next_mults=[1.0, 0.5], router=(proj, rn, 0.3))
    torch.testing.assert_close(ys[2].float(), ref[2].float(), rtol=tol, atol=tol * 2)
    with pytest.raises(ValueError, match="router weight"):
        sandwich_rmsnorm(x, res, w, 1e-6, next_weights=nw, router=(proj[:, :5], rn, 0.3))


def test_sandwich_router_traffic():
    base = sandwich_rmsnorm_traffic(1, 2816, num_next=2)
    r = sandwich_rmsnorm_traffic(1, 2816, num_next=2, router_experts=128)
    assert r["bytes_read"] - base["bytes_read"] == 129 * 2816 * 2
    assert r["bytes_written"] - base["bytes_written"] == 128 * 2
    assert r["flops"] - base["flops"] == 2 * 128 * 2816


_SM90_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from perfkit.kernels import moe_ffn as mf, rmsnorm as rn

def compile(fn, sig, consts, warps):
    s = sig | dict.fromkeys(consts, "constexpr")
    try:
        k = triton.compile(ASTSource(fn, s, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        return "griddepcontrol.wait" in k.asm["ptx"]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:2000]

rows = []
ptrs = ("xd_ptr", "xe_ptr", "wd_ptr", "we_ptr", "hd_ptr", "act_ptr", "logits_ptr")
sig = dict.fromkeys(ptrs, "*bf16") | {"scale_ptr": "*fp32", "rw_ptr": "*fp32", "ridx_ptr": "*i32"}
sig |= dict.fromkeys(("I_d", "I_e", "H", "E", "stride_wd", "stride_we", "stride_wen", "stride_act"), "i32")
for routed in (1, 0):  # (ASTSource applies no defaults: every constexpr given)
    rows.append(compile(mf._moe_ffn_gate_up_kernel, sig, {"TOP_K": 8, "BLOCK_TOPK": 8, "BLOCK_E": 128, "BLOCK_N": 8,
                                                          "BLOCK_K": 256, "ROUTED": routed, "PDL": 1}, 2))
ptrs = ("hd_ptr", "wd_ptr", "act_ptr", "we_ptr", "m_ptr", "e_ptr")
sig = dict.fromkeys(ptrs, "*bf16") | {"rw_ptr": "*fp32", "ridx_ptr": "*i32"}
sig |= dict.fromkeys(("H", "I_d", "I_e", "stride_wd", "stride_we", "stride_wen", "stride_act"), "i32")
rows.append(compile(mf._moe_ffn_down_kernel, sig, {"TOP_K": 8, "D_SLOTS": 8, "D_SLOT": 264, "BLOCK_N": 8,
                                                   "BLOCK_K": 128, "PDL": 1}, 4))
ptrs = ("x_ptr", "x2_ptr", "wa_ptr", "wb_ptr", "res_ptr", "w_ptr", "scalar_ptr", "h_ptr", "w1_ptr", "w2_ptr",
        "w3_ptr", "y1_ptr", "y2_ptr", "y3_ptr", "rw_ptr", "rn_ptr", "logits_ptr")
sig = dict.fromkeys(ptrs, "*bf16") | dict.fromkeys(("N", "stride_x", "stride_x2", "stride_r", "E"), "i32")
sig |= dict.fromkeys(("eps", "mult1", "mult2", "mult3", "rmult"), "fp32")
for has_router, has_x2 in ((1, 0), (0, 0), (0, 1)):
    consts = {"HAS_X2": has_x2, "HAS_SCALAR": has_x2, "NUM_NEXT": 2, "BLOCK_N": 4096, "HAS_ROUTER": has_router,
              "ROUTER_ROWS": 4, "PDL": 1}
    rows.append(compile(rn._sandwich_kernel, sig, consts, 16))
print(json.dumps(rows))
"""


def test_kernels_compile_for_sm90():
    """Ahead-of-time compile for sm_90 (no GPU needed; the interpreter accepts code the compiler refuses): both
    FFN kernels and the sandwich with and without its router programs, with PDL."""
    from aot import sm90_rows

    assert sm90_rows(_SM90_COMPILE) == [True] * 6


# ---- the model and the engine ------------------------------------------------------------------------------------


class _Spy(_FusionSpy):
    NAMES = ("moe_ffn", "gemv_pair", "gemv_routed", "moe_routing", "fused_moe", "sandwich")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_runs_the_block_in_two_launches(dtype, monkeypatch):
    """One token: every MoE layer runs moe_ffn (no gemv_pair / gemv_routed / routing / gather launches) and one
    sandwich per layer carries the router; the logits match the separate path's (fp32 to rounding; bf16 within a
    few ulps of the logits' scale) and so does the greedy token."""
    cfg, model = _model("tiny-moe", dtype)
    ids = torch.tensor([5])
    model.set_decode_fusion(True, routed=True)
    ref = _forward(model, ids)
    model.set_decode_fusion(True, routed=True, moe_ffn="fused")
    spy = _Spy(monkeypatch)
    out = _forward(model, ids)
    L = cfg.num_hidden_layers
    assert spy.calls["moe_ffn"] == L and spy.routers == L
    assert spy.calls["gemv_pair"] == spy.calls["gemv_routed"] == spy.calls["moe_routing"] == spy.calls["fused_moe"] == 0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_fallbacks_keep_the_separate_launches(monkeypatch):
    """Two rows, or decode_fusion off (the toggle rides with it): the separate launches, logits bit for bit."""
    cfg, model = _model("tiny-moe")
    two = torch.tensor([5, 9])
    model.set_decode_fusion(True, routed=True)
    ref2 = _forward(model, two)
    model.set_decode_fusion(True, routed=True, moe_ffn="fused")
    spy = _Spy(monkeypatch)
    assert torch.equal(_forward(model, two), ref2)
    assert spy.calls["moe_ffn"] == 0 and spy.routers == 0 and spy.calls["fused_moe"] == cfg.num_hidden_layers
    model.set_decode_fusion(False, moe_ffn="fused")
    assert all(layer.decode_moe_ffn == "separate" for layer in model.layers)
    one = torch.tensor([5])
    _forward(model, one)
    assert spy.calls["moe_ffn"] == 0


def test_a_dense_model_is_untouched(monkeypatch):
    _, model = _model("tiny")
    ids = torch.tensor([5])
    model.set_decode_fusion(True, routed=True)
    ref = _forward(model, ids)
    model.set_decode_fusion(True, routed=True, moe_ffn="fused")
    spy = _Spy(monkeypatch)
    assert torch.equal(_forward(model, ids), ref) and spy.calls["moe_ffn"] == 0 and spy.routers == 0


# The engine toggle's CPU check (also tests/test_ffn_branches.py's): torch attention, the fused path, three prompts.
CPU_ENGINE = dict(attention="torch", page_size=4, max_batch_size=4, max_num_tokens=16, num_kv_pages=200,
                  cuda_graphs=False, mask="dense", max_model_len=128, fused_kernels=True, decode_gemv="triton",
                  decode_fusion=True, decode_routing=True)  # fmt: skip


def _cpu_tokens(engine) -> list:
    """Greedy tokens of three short prompts (3-5 new tokens each), in request order."""
    rids = [engine.add_request(p, max_new_tokens=3 + i) for i, p in enumerate([[5, 6, 7], [9, 4], [11, 12, 13, 14]])]
    got = engine.generate_all()
    return [got[r] for r in rids]


def test_toggle_config_and_engine_tokens():
    """The toggle's values and default; an engine (torch attention, fused path) gives the same greedy tokens with
    decode_moe_ffn fused as separate, also switched on a live engine (fp32: the arms agree to rounding)."""
    assert TOGGLES["decode_moe_ffn"] == ("separate", "fused", "branches")
    assert Toggles().decode_moe_ffn == "branches" and PartialToggles(decode_moe_ffn="fused").decode_moe_ffn == "fused"
    cfg, model = _model("tiny-moe")
    kw, run = CPU_ENGINE, _cpu_tokens
    off = run(Engine(copy.deepcopy(model), cfg, EngineConfig(**kw)))
    on = run(Engine(copy.deepcopy(model), cfg, EngineConfig(**kw, decode_moe_ffn="fused")))
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("decode_moe_ffn", "fused")
    assert live.toggles()["decode_moe_ffn"] == "fused" and model.layers[0].decode_moe_ffn == "fused"
    assert off == on == run(live)
    live.set_toggle("decode_fusion", "off")  # the block goes with the fusion; it stays chosen for later
    assert model.layers[0].decode_moe_ffn == "separate" and live.toggles()["decode_moe_ffn"] == "fused"


# ---- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_gpu_block_in_a_graph_matches_the_separate_launches():
    """Real 26B-A4B shapes, bf16, PDL, 30 layers in one CUDA graph replayed 20 times on new inputs: each layer's
    [sandwich + router] -> moe_ffn gives the expert ids of the separate routing, the experts' output of the gather
    path on the graph's own routing bit for bit, and a dense output within a bf16 ulp or two of gemv's chain."""
    from perfkit.kernels.gemv import GEMV_TILES, gemv, gemv_pair

    gen = torch.Generator(device="cuda").manual_seed(6)
    H, I_d, E, I_e = 2816, 2112, 128, 704

    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(torch.bfloat16)

    w_gu, w_dn, w_r = rnd(2 * I_d, H), rnd(H, I_d), rnd(E, H, s=0.05)
    e_gu, e_dn = rnd(E, 2 * I_e, H), rnd(E, H, I_e)
    scale = torch.rand(E, device="cuda", generator=gen) + 0.5
    post, pre, pre2, rnorm = (rnd(H, s=1.0) for _ in range(4))
    a, res = rnd(30, H, s=1.0), rnd(30, H, s=1.0)
    tile = GEMV_TILES[2]
    root = H**-0.5

    def layer(i):
        _, ys = sandwich_rmsnorm(a[i : i + 1], res[i : i + 1], post, 1e-6, next_weights=[pre, pre2],
                                 router=(w_r, rnorm, root), pdl=True)  # fmt: skip
        return ys, moe_ffn(ys[0], ys[1], ys[2], w_gu, w_dn, e_gu, e_dn, 8, scale, pdl=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [layer(i) for i in range(30)]
    worst = 0.0
    for _ in range(20):
        a.copy_(rnd(30, H, s=1.0))
        graph.replay()
        torch.cuda.synchronize()
        for i, (ys, (m, e)) in enumerate(outs):
            _, ys0 = sandwich_rmsnorm(a[i : i + 1], res[i : i + 1], post, 1e-6, next_weights=[pre, pre2, rnorm],
                                      next_mults=[1.0, 1.0, root])  # fmt: skip
            assert torch.equal(ys[0], ys0[0]) and torch.equal(ys[1], ys0[1])
            gu, logits = gemv_pair(ys0[0], w_gu, ys0[2], w_r, tile)
            torch.testing.assert_close(ys[2].float(), logits.float(), rtol=1e-2, atol=1e-2)
            w, idx = moe.moe_routing(ys[2], 8, scale)
            assert torch.equal(e, moe.fused_moe(ys[1], e_gu, e_dn, w, idx, path="gather"))
            m_ref = gemv(gu, w_dn, tile, glu=True)
            worst = max(worst, ((m.float() - m_ref.float()).abs().max() / m_ref.float().abs().max()).item())
    assert worst < 2e-2, worst


def _gpu_engine_case(seed: int, requests: int = 12, max_batch_size: int = 8):
    """(cfg, model, engine settings, runner) of the GPU engine checks (also tests/test_ffn_branches.py's): a
    real-width 26B-A4B with 2 layers on CUDA, FlashInfer + CUDA graphs + the fused path + PDL where it runs, and a
    runner of ``requests`` requests of staggered lengths (mixed steps, then tails of 1 to ``max_batch_size`` rows)
    that checks for page leaks."""
    from perfkit.kernels.pdl import pdl_available

    cfg = get_preset("26b-a4b", num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    rng = random.Random(seed)
    reqs = [[rng.randint(3, 250_000 - 1) for _ in range(rng.randint(1, 200))] for _ in range(requests)]
    kw = dict(attention="flashinfer", cuda_graphs=True, page_size=16, max_batch_size=max_batch_size, max_num_tokens=512,
              num_kv_pages=2000, max_model_len=1024, mask="triton", fused_kernels=True, decode_gemv="triton",
              pdl=pdl_available(torch.device("cuda")), decode_fusion=True, decode_routing=True)  # fmt: skip

    def run(e) -> list:
        rids = [e.add_request(p, max_new_tokens=8 + (i % 5) * 6) for i, p in enumerate(reqs)]
        got = e.generate_all()
        e.bm.check_no_leaks()
        return [got[r] for r in rids]

    return cfg, model, kw, run


@pytest.mark.gpu
@gpu
def test_gpu_engine_tokens_with_the_block_fused():
    """A real-width 26B-A4B with 2 layers, FlashInfer + CUDA graphs + the fused path + PDL, staggered lengths
    (mixed steps, then batch-1 tails): decode_moe_ffn fused gives the separate arm's greedy tokens, also switched
    on a live engine."""
    cfg, model, kw, run = _gpu_engine_case(29)
    off = run(Engine(model, cfg, EngineConfig(**kw)))
    on = run(Engine(model, cfg, EngineConfig(**kw, decode_moe_ffn="fused")))
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("decode_moe_ffn", "fused")
    assert on == off and run(live) == off
