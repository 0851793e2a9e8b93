"""Toggle decode_fusion: batch-1 decode in fewer launches per layer, each fusion bit-identical to the launches it
replaces. On CPU under TRITON_INTERPRET=1 (tests/conftest.py): the down gemv's GeGLU on load and the 26B-A4B
router's product paired with the dense gate_up's gemv; which launches run (spies on the shared kernel namespace),
logits equal bit for bit with the fusions on and off, the fallbacks (two rows, cuBLAS shapes), the engine toggle and
its config. On the GPU: both kernels at real shapes, and the engine's greedy tokens identical with decode_fusion on
and off (FlashInfer, CUDA graphs, the Triton decode, PDL) on real-width 31B / 26B-A4B models with 2 layers.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("triton")

from perfkit.config import PartialToggles, Toggles  # noqa: E402
from perfkit.runtime import model as model_mod  # noqa: E402
from perfkit.runtime.attention.contiguous import ContiguousAttention  # noqa: E402
from perfkit.runtime.engine import TOGGLES, Engine, EngineConfig  # noqa: E402
from perfkit.runtime.model_config import get_preset  # noqa: E402
from perfkit.runtime.weights import build_model  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(name: str, dtype: torch.dtype = torch.float32):
    """A preset on the CPU with the fused path and perfkit's gemv at one row (also tests/test_moe_ffn.py's)."""
    cfg = get_preset(name)
    model = build_model(cfg, "cpu", dtype, seed=0)
    model.set_fused(True)
    model.set_decode_gemv("triton")
    return cfg, model


def _forward(model, ids: torch.Tensor) -> torch.Tensor:
    attn = ContiguousAttention()
    attn.prepare(ids.numel())
    return model(ids, torch.arange(ids.numel()), attn)


class _Spy:
    """Counts calls of the shared kernel namespace's launchers (model._kernels() is cached per pdl value), those
    with glu=True and those with a router (tests/test_moe_ffn.py's spy: other NAMES)."""

    NAMES = ("gemv", "gemv_pair", "gemv_routed", "gelu_mul_cat", "moe_routing")

    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = dict.fromkeys(self.NAMES, 0)
        self.glu = 0
        self.routers = 0
        ns = model_mod._kernels()
        for name in self.NAMES:
            monkeypatch.setattr(ns, name, self._wrap(name, getattr(ns, name)))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.calls[name] += 1
            self.glu += bool(kwargs.get("glu"))
            self.routers += kwargs.get("router") is not None
            return fn(*args, **kwargs)

        return spy


@pytest.mark.parametrize("name,routed", [("tiny", False), ("tiny-moe", False), ("tiny-moe", True)])
def test_fusions_are_bit_identical_and_launch_less(name, routed, monkeypatch):
    """One token: logits equal bit for bit with decode_fusion off and on (under the interpreter the routing's
    sums come out the same in either launch); on, every MLP's down gemv takes the gate_up output (no gelu_mul),
    and every MoE layer pairs its router with the dense gate_up (no router gemv) and, routed (decode_routing
    fused), routes in the down gemv's launch (no routing launch)."""
    cfg, model = _model(name)
    ids = torch.tensor([5])
    ref = _forward(model, ids)
    spy = _Spy(monkeypatch)
    model.set_decode_fusion(True, routed=routed)
    out = _forward(model, ids)
    assert torch.equal(out, ref)
    L = cfg.num_hidden_layers
    moe_layers = L if cfg.enable_moe_block else 0
    assert spy.calls["gelu_mul_cat"] == 0 and spy.glu == L and spy.calls["gemv_pair"] == moe_layers
    assert spy.calls["gemv_routed"] == (moe_layers if routed else 0)
    assert spy.calls["moe_routing"] == (0 if routed else moe_layers)
    gemvs_on = spy.calls["gemv"] + spy.calls["gemv_routed"]
    model.set_decode_fusion(False)
    spy.calls = dict.fromkeys(_Spy.NAMES, 0)
    assert torch.equal(_forward(model, ids), ref)
    assert spy.calls["gelu_mul_cat"] == L and spy.calls["gemv_routed"] == 0
    assert spy.calls["moe_routing"] == moe_layers
    assert spy.calls["gemv"] == gemvs_on + 2 * moe_layers  # gate_up and the router, apart


def test_fallbacks_keep_the_separate_launches(monkeypatch):
    """Two tokens: no gemv at all, so gelu_mul and the router's own GEMM run. cuBLAS shapes (decode_gemv=cublas):
    nothing pairs or fuses into a gemv. Both equal the separate launches bit for bit."""
    cfg, model = _model("tiny-moe")
    ids = torch.tensor([5, 9])
    ref = _forward(model, ids)
    spy = _Spy(monkeypatch)
    model.set_decode_fusion(True, routed=True)
    assert torch.equal(_forward(model, ids), ref)
    L = cfg.num_hidden_layers
    assert spy.calls["gemv_routed"] == 0 and spy.glu == 0 and spy.calls["gelu_mul_cat"] == L
    assert spy.calls["moe_routing"] == L
    model.set_decode_gemv("cublas")
    one = torch.tensor([5])
    model.set_decode_fusion(False)
    ref1 = _forward(model, one)
    model.set_decode_fusion(True, routed=True)
    spy.calls, spy.glu = dict.fromkeys(_Spy.NAMES, 0), 0
    assert torch.equal(_forward(model, one), ref1)
    assert spy.calls["gemv"] == spy.calls["gemv_routed"] == spy.glu == 0 and spy.calls["moe_routing"] == L


def test_a_down_shape_without_a_glu_tile_keeps_gelu_mul(monkeypatch):
    """decode_gemv=auto leaves a down shape out of ``glu_tiles`` where the GLU form timed slower (31B's down, 12-08):
    decode_fusion then runs gelu_mul and the plain down gemv there, the router still pairs, and decode_routing
    fused routes in the plain down gemv's launch."""
    cfg, model = _model("tiny-moe")
    ids = torch.tensor([5])
    ref = _forward(model, ids)
    assert model._down_keys() and all(m.glu_tiles for m in model.modules() if isinstance(m, model_mod.Gemma4MLP))
    model._set_module_flag("glu_tiles", {})
    model.set_decode_fusion(True, routed=True)
    spy = _Spy(monkeypatch)
    assert torch.equal(_forward(model, ids), ref)
    L = cfg.num_hidden_layers
    assert spy.glu == 0 and spy.calls["gelu_mul_cat"] == L and spy.calls["gemv_pair"] == L
    assert spy.calls["gemv_routed"] == L and spy.calls["moe_routing"] == 0


def test_glu_timing_picks_the_glu_form_only_where_it_beats_the_two_launches(monkeypatch):
    """time_gemv_choice(glu=True) with a scripted timer (each timed function still runs once, under the
    interpreter): the GLU row names the separate chain unless a GLU tile beat it outright."""
    from perfkit.kernels import gemv as gv

    def scripted(times):
        it = iter(times)

        def fake(fn, args, calls, replays):
            fn(args[0])
            return next(it)

        return fake

    w = torch.randn(8, 32)
    n = len(gv.GEMV_TILES)
    # cuBLAS 10, the plain tiles 9..., the separate chain 12, the GLU tiles 13...: the chain wins
    monkeypatch.setattr(gv, "graph_sequence_us", scripted([10.0, *range(9, 9 - n, -1), 12.0, *range(13, 13 + n)]))
    row = gv.time_gemv_choice([w], glu=True)
    assert row["best"] == gv.GEMV_TILES[-1].label and row["glu"]["best"] == "separate"
    assert row["glu"]["separate_us"] == 12.0 and len(row["glu"]["tiles"]) == n
    # the second GLU tile beats the chain: it is the GLU row's winner
    monkeypatch.setattr(gv, "graph_sequence_us", scripted([10.0, *[11.0] * n, 12.0, 13.0, 11.5, *[14.0] * (n - 2)]))
    row = gv.time_gemv_choice([w], glu=True)
    assert row["best"] == "cublas" and row["glu"]["best"] == gv.GEMV_TILES[1].label and row["glu"]["best_us"] == 11.5
    monkeypatch.setattr(gv, "graph_sequence_us", scripted([10.0, *[11.0] * n]))
    assert "glu" not in gv.time_gemv_choice([w])


def test_set_decode_fusion_reaches_the_layers():
    _, model = _model("tiny-moe")
    model.set_decode_fusion(True)
    flagged = [m for m in model.modules() if hasattr(type(m), "decode_fusion")]
    assert {type(m).__name__ for m in flagged} == {"Gemma4MLP", "Gemma4DecoderLayer"}
    assert all(m.decode_fusion for m in flagged)
    twin = copy.deepcopy(model)
    assert twin.layers[0].decode_fusion
    assert not any(layer.decode_routing for layer in model.layers)  # decode_routing separate
    model.set_decode_fusion(True, routed=True)
    assert all(layer.decode_routing for layer in model.layers)
    model.set_decode_fusion(False, routed=True)  # routing rides only with the fusion
    assert not any(m.decode_fusion for m in flagged)
    assert not any(layer.decode_routing for layer in model.layers)


def test_toggle_config_and_engine_tokens():
    """The toggles' values and defaults; an engine (torch attention, fused path, gemv) gives the same tokens with
    decode_fusion on, off, and switched on a live engine, and with decode_routing fused switched on live."""
    assert TOGGLES["decode_fusion"] == ("on", "off") and TOGGLES["decode_routing"] == ("separate", "fused")
    assert Toggles().decode_fusion == "on" and Toggles(decode_fusion=False).decode_fusion == "off"  # YAML's off
    assert PartialToggles(decode_fusion=True).decode_fusion == "on"
    assert Toggles().decode_routing == "fused" and PartialToggles(decode_routing="separate").decode_routing == "separate"
    cfg = get_preset("tiny-moe")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    kw = dict(attention="torch", page_size=4, max_batch_size=4, max_num_tokens=16, num_kv_pages=200,
              cuda_graphs=False, mask="dense", max_model_len=128, fused_kernels=True, decode_gemv="triton")  # fmt: skip
    prompts = [[5, 6, 7], [9, 4], [11, 12, 13, 14]]

    def run(engine):
        rids = [engine.add_request(p, max_new_tokens=3 + i) for i, p in enumerate(prompts)]
        got = engine.generate_all()
        return [got[r] for r in rids]

    off = run(Engine(copy.deepcopy(model), cfg, EngineConfig(**kw)))
    on = run(Engine(copy.deepcopy(model), cfg, EngineConfig(**kw, decode_fusion=True)))
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("decode_fusion", "on")
    assert live.toggles()["decode_fusion"] == "on" and model.layers[0].decode_fusion
    assert off == on == run(live)
    live.set_toggle("decode_routing", "fused")
    assert live.toggles()["decode_routing"] == "fused" and model.layers[0].decode_routing
    assert run(live) == off
    live.set_toggle("decode_fusion", "off")  # the routing goes with the fusion; it stays chosen for later
    assert not model.layers[0].decode_routing and live.toggles()["decode_routing"] == "fused"


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [(2816, 2112), (5376, 21504)])
def test_gpu_glu_gemv_is_gelu_mul_then_gemv(N, K):
    from perfkit.kernels.gelu_mul import gelu_mul_cat
    from perfkit.kernels.gemv import GEMV_TILES, gemv

    gen = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(1, 2 * K, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    for tile in GEMV_TILES:
        for pdl in (False, True):
            assert torch.equal(gemv(x, w, tile, glu=True, pdl=pdl), gemv(gelu_mul_cat(x), w, tile, pdl=pdl))


@pytest.mark.gpu
@gpu
def test_gpu_gemv_pair_is_two_gemvs():
    """The 26B-A4B dense gate_up (4224 x 2816) with its router (128 x 2816), every tile."""
    from perfkit.kernels.gemv import GEMV_TILES, gemv, gemv_pair

    gen = torch.Generator(device="cuda").manual_seed(3)
    x, x2 = (torch.randn(1, 2816, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    w = (torch.randn(4224, 2816, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(128, 2816, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    for tile in GEMV_TILES:
        a, b = gemv_pair(x, w, x2, w2, tile, pdl=True)
        assert torch.equal(a, gemv(x, w, tile)) and torch.equal(b, gemv(x2, w2, tile))


@pytest.mark.gpu
@gpu
def test_gpu_gemv_routed_is_gemv_then_routing():
    """The 26B-A4B down (2816 x 2112; GLU and plain) with the top-8 routing of 128 logits in one launch, every tile,
    PDL: the product equals gemv's bit for bit, the expert ids equal moe_routing's and the weights to fp32 rounding (on the
    GPU the softmax sums follow each kernel's warp layout)."""
    from perfkit.kernels.gemv import GEMV_TILES, gemv, gemv_routed
    from perfkit.kernels.moe import moe_routing

    gen = torch.Generator(device="cuda").manual_seed(4)
    gu = torch.randn(1, 2 * 2112, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(2816, 2112, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    logits = torch.randn(1, 128, device="cuda", generator=gen).to(torch.bfloat16) * 3
    scale = torch.rand(128, device="cuda", generator=gen) + 0.5
    ref_w, ref_idx = moe_routing(logits, 8, scale)
    for tile in GEMV_TILES:
        for x, glu in ((gu, True), (gu[:, :2112], False)):
            out, rw, ridx = gemv_routed(x, w, logits, 8, scale, tile, pdl=True, glu=glu)
            assert torch.equal(out, gemv(x, w, tile, glu=glu)) and torch.equal(ridx, ref_idx)
            torch.testing.assert_close(rw, ref_w, rtol=1e-6, atol=0)


@pytest.mark.gpu
@gpu
def test_gpu_routed_moe_chain_in_a_graph():
    """The 26B-A4B batch-1 MLP + MoE chain as the model runs it with decode_fusion, decode_routing fused and PDL: an
    rmsnorm writes the inputs, gemv_pair (dense gate_up + router), gemv_routed (the GLU down + the routing), then
    the experts' two gather kernels. 40 replays of one graph holding 30 such layers, new inputs each time: the
    down output equals gemv's, the expert ids the routing kernel's, and the experts' output a plain launch's on
    the graph's own routing (whose weights may differ from the routing kernel's by fp32 rounding)."""
    from perfkit.kernels.gemv import GEMV_TILES, gemv, gemv_pair, gemv_routed
    from perfkit.kernels.moe import fused_moe, moe_routing
    from perfkit.kernels.rmsnorm import rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(6)
    H, inter, E, Im = 2816, 2112, 128, 704

    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(torch.bfloat16)

    w_gu, w_dn, w_r = rnd(2 * inter, H), rnd(H, inter), rnd(E, H, s=0.05)
    e_gu, e_dn = rnd(E, 2 * Im, H), rnd(E, H, Im)
    scale, nw = torch.rand(E, device="cuda", generator=gen) + 0.5, rnd(H, s=1.0)
    a = rnd(30, H, s=1.0)
    tile = GEMV_TILES[2]

    def layer(i):
        x = rmsnorm(a[i : i + 1], nw, 1e-6, pdl=True)
        gu, logits = gemv_pair(x, w_gu, x, w_r, tile, pdl=True)
        y, rw, ridx = gemv_routed(gu, w_dn, logits, 8, scale, tile, pdl=True, glu=True)
        return y, rw, ridx, fused_moe(x, e_gu, e_dn, rw, ridx, path="gather", pdl=True)

    def check(i, y, rw, ridx, out):
        x = rmsnorm(a[i : i + 1], nw, 1e-6)
        gu, logits = gemv_pair(x, w_gu, x, w_r, tile)
        assert torch.equal(y, gemv(gu, w_dn, tile, glu=True))
        assert torch.equal(ridx, moe_routing(logits, 8, scale)[1])
        assert torch.equal(out, fused_moe(x, e_gu, e_dn, rw, ridx, path="gather"))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [layer(i) for i in range(30)]
    for _ in range(40):
        a.copy_(rnd(30, H, s=1.0))
        graph.replay()
        torch.cuda.synchronize()
        for i, o in enumerate(outs):
            check(i, *o)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", ["31b", "26b-a4b"])
def test_gpu_engine_tokens_identical_with_decode_fusion(preset):
    """Real widths with 2 layers, FlashInfer + CUDA graphs + the fused path, decode_gemv=triton, the Triton decode
    (max_batch_size 8), PDL where available, staggered lengths (mixed steps, then batch-1 tails): decode_fusion on
    gives the same tokens as off, and so does switching it on a live engine."""
    from perfkit.kernels.pdl import pdl_available

    cfg = get_preset(preset, num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    rng = random.Random(29)
    reqs = [[rng.randint(3, 250_000 - 1) for _ in range(rng.randint(1, 200))] for _ in range(12)]
    kw = dict(attention="flashinfer", cuda_graphs=True, page_size=16, max_batch_size=8, max_num_tokens=512,
              num_kv_pages=2000, max_model_len=1024, mask="triton", fused_kernels=True, decode_gemv="triton",
              pdl=pdl_available(torch.device("cuda")))  # fmt: skip

    def run(e):
        rids = [e.add_request(p, max_new_tokens=8 + (i % 5) * 6) for i, p in enumerate(reqs)]
        got = e.generate_all()
        e.bm.check_no_leaks()
        return [got[r] for r in rids]

    outs = [run(Engine(model, cfg, EngineConfig(**kw, decode_fusion=f))) for f in (False, True)]
    # decode_routing fused: the routing weights differ from the routing kernel's by fp32 rounding at most (the
    # expert ids and these tokens matched)
    assert run(Engine(model, cfg, EngineConfig(**kw, decode_fusion=True, decode_routing=True))) == outs[0]
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("decode_fusion", "on")
    assert live.toggles()["decode_fusion"] == "on"
    outs.append(run(live))
    assert outs[0] == outs[1] == outs[2]
