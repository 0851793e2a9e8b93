"""Programmatic dependent launch (perfkit/kernels/pdl.py, toggle pdl): the launch arguments, where it is refused
(off CUDA, under the interpreter: one clear error, nothing changed), the model's and engine's plumbing, and a
source check that every kernel taking a PDL flag waits on every path before it touches memory. On the GPU: each
launcher gives bit-identical outputs with and without PDL (the same kernel and arithmetic), and the engine's greedy
tokens are identical with pdl on and off (CUDA graphs, mixed steps, batch-1 gemv steps, the MoE gather kernels).
"""

from __future__ import annotations

import ast
import copy
import inspect
import random
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from perfkit.config import Toggles  # noqa: E402
from perfkit.errors import PerfkitError  # noqa: E402
from perfkit.kernels import (  # noqa: E402
    fp8_gemv,
    gelu_mul,
    gemv,
    moe,
    moe_ffn,
    paged_decode,
    pdl,
    qk_norm_rope,
    rmsnorm,
    stream,
    w4a16_gemm,
)
from perfkit.runners.suite import resolve_toggles  # noqa: E402
from perfkit.runtime import model as model_mod  # noqa: E402
from perfkit.runtime.engine import TOGGLES, Engine, EngineConfig  # noqa: E402
from perfkit.runtime.model_config import get_preset  # noqa: E402
from perfkit.runtime.weights import build_model  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KERNEL_MODULES = (fp8_gemv, gelu_mul, gemv, moe, moe_ffn, paged_decode, qk_norm_rope, rmsnorm, stream, w4a16_gemm)


# ---- launch arguments and availability ----------------------------------------------------------------------
def test_launch_arguments():
    assert pdl.pdl_launch(False) == {"PDL": 0}
    assert pdl.pdl_launch(True) == {"PDL": 1, "launch_pdl": True}


def test_not_available_off_cuda_or_under_the_interpreter(monkeypatch):
    assert not pdl.pdl_available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_available(torch.device("cuda"))  # the interpreter has no griddepcontrol


# ---- the kernels' side of the contract ------------------------------------------------------------------------
def _pdl_kernels():
    """(name, source) of every @triton.jit function in the decode-path kernel modules that takes a PDL flag."""
    out = []
    for mod in KERNEL_MODULES:
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            own = fn is not None and fn.__module__ == mod.__name__  # not pdl_enter itself, imported
            if own and "PDL" in getattr(obj, "arg_names", ()):
                out.append((f"{mod.__name__}.{name}", textwrap.dedent(inspect.getsource(fn))))
    return out


def test_every_pdl_kernel_waits_before_any_store_or_return():
    """pdl_enter(PDL) must run on every path before a kernel reads a predecessor's output or writes anything:
    here, as a top-level statement of the kernel body that comes before every store, atomic, return and loop
    (constexpr branches may come first; the loads allowed before it are of weights, which no kernel writes:
    reviewed by hand)."""
    kernels = _pdl_kernels()
    names = {n.rsplit(".", 1)[1] for n, _ in kernels}
    assert {"_gemv_kernel", "_rmsnorm_kernel", "_sandwich_kernel", "_gelu_mul_kernel", "_qk_norm_rope_kernel",
            "_qkv_norm_rope_kernel", "_paged_decode_kernel", "_merge_splits_kernel", "_moe_routing_kernel",
            "_moe_gather_gate_up_kernel", "_moe_gather_down_kernel", "_moe_ffn_gate_up_kernel",
            "_moe_ffn_down_kernel", "_w4a16_gemv_tc_kernel", "_w4a16_gemv_wide_kernel", "_stream_kernel",
            "_fp8_gemv_kernel"} <= names  # fmt: skip
    for name, src in kernels:
        body = ast.parse(src).body[0].body
        enters = [i for i, st in enumerate(body) if "pdl_enter(PDL)" in ast.unparse(st) and isinstance(st, ast.Expr)]
        assert len(enters) == 1, f"{name}: one top-level pdl_enter(PDL) statement"
        docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        before = "\n".join(ast.unparse(st) for st in body[int(docstring) : enters[0]])
        for forbidden in ("tl.store", "tl.atomic", "return", "for ", "while "):
            assert forbidden not in before, f"{name}: {forbidden!r} before pdl_enter"


# ---- the model and the engine ----------------------------------------------------------------------------------
def test_kernels_namespace_binds_the_flag():
    k0, k1 = model_mod._kernels(), model_mod._kernels(True)
    assert k0 is model_mod._kernels(False) and k1 is not k0
    assert k1.gemv.keywords == {"pdl": True} and k0.sandwich.keywords == {"pdl": False}
    assert k1.split_qkv is qk_norm_rope.split_qkv  # views only: nothing to launch


def test_set_pdl_reaches_every_module_that_launches():
    model = build_model(get_preset("tiny-moe"), "cpu", torch.float32, seed=0)
    model.set_fused(True)
    model.set_pdl(True)
    flagged = [m for m in model.modules() if hasattr(type(m), "pdl")]
    assert flagged and all(m.pdl is True for m in flagged)
    kinds = {type(m).__name__ for m in flagged}
    assert {"RMSNorm", "Gemma4MLP", "Gemma4Attention", "Gemma4Experts", "Gemma4DecoderLayer",
            "Gemma4ForCausalLM"} <= kinds  # fmt: skip
    model.set_pdl(False)
    assert not any(m.pdl for m in flagged)


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
def test_set_pdl_reaches_the_quantized_linears(monkeypatch, scheme):
    """The NVFP4 / FP8 linears take the model's flag and pass it to their decode kernel (``w4a16_gemm``'s M = 1
    gemv kernels, ``fp8_gemv``; the CPU run here only checks the plumbing)."""
    from perfkit.runtime import quant

    cls, fn, backend = {"nvfp4": (quant.Nvfp4Linear, "w4a16_gemm", "w4a16-triton"),
                        "fp8": (quant.Fp8Linear, "fp8_gemv", "fp8-scaled-mm")}[scheme]  # fmt: skip
    model = build_model(get_preset("tiny"), "cpu", torch.float32, seed=0)
    quant.quantize_model_(model, scheme)
    lins = [m for m in model.modules() if isinstance(m, cls)]
    assert lins and not any(m.pdl for m in lins)
    model.set_pdl(True)
    assert all(m.pdl is True for m in lins)
    lin = lins[0]
    seen = []
    monkeypatch.setattr(quant, fn, lambda x, *a, **kw: seen.append(kw["pdl"]) or x @ lin.dequantized_weight().T)
    lin.backend = backend
    lin(torch.randn(1, lin.in_features))
    assert seen == [True]


def _engine_kw():
    return dict(attention="torch", page_size=4, max_batch_size=4, max_num_tokens=16, num_kv_pages=200,
                cuda_graphs=False, mask="dense", max_model_len=128, fused_kernels=True)  # fmt: skip


def test_engine_refuses_pdl_where_it_cannot_run():
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    assert TOGGLES["pdl"] == ("on", "off")
    with pytest.raises(PerfkitError, match="pdl=on needs a CUDA GPU of compute capability 9.0"):
        Engine(copy.deepcopy(model), cfg, EngineConfig(**_engine_kw(), pdl=True))
    engine = Engine(model, cfg, EngineConfig(**_engine_kw()))
    assert engine.toggles()["pdl"] == "off"
    with pytest.raises(PerfkitError, match="pdl=on needs"):
        engine.set_toggle("pdl", "on")
    assert engine.toggles()["pdl"] == "off" and not model.pdl  # nothing changed
    rid = engine.add_request([5, 6, 7], max_new_tokens=3)
    assert len(engine.generate_all()[rid]) == 3


def test_toggle_resolution():
    assert Toggles().pdl == "auto"
    assert Toggles(pdl=True).pdl == "on"  # YAML's bare on
    assert resolve_toggles(Toggles(pdl="auto"), "cpu").pdl == "off"
    assert resolve_toggles(Toggles(pdl="off"), "cpu").pdl == "off"
    with pytest.raises(PerfkitError, match="toggles.pdl=on needs a CUDA GPU"):
        resolve_toggles(Toggles(pdl="on"), "cpu")


# ---- GPU ---------------------------------------------------------------------------------------------------------
def _launchers(dev: str):
    """(name, fn(pdl) -> tensors) for every launcher with a pdl argument, on small real-width inputs."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    x, w = rnd(1, 2816), rnd(4224, 2816, scale=0.02)
    h, res, nw = rnd(3, 2816), rnd(3, 2816), rnd(2816)
    qkv = rnd(3, (16 + 2 + 2) * 256)
    q_raw, k_raw, v_raw = qk_norm_rope.split_qkv(qkv, 16, 2, 256, False)
    cos, sin = rnd(3, 128), rnd(3, 128)
    cache = torch.zeros(8, 2, 16, 2, 256, device=dev, dtype=torch.bfloat16)
    slots = (torch.tensor([1, 1, 2], device=dev), torch.tensor([0, 1, 5], device=dev))
    pcache = rnd(8, 2, 16, 2, 256)
    ind, ptr = torch.arange(8, device=dev, dtype=torch.int32), torch.tensor([0, 5, 8], device=dev, dtype=torch.int32)
    lens, qd = torch.tensor([70, 40], device=dev, dtype=torch.int32), rnd(2, 16, 256)
    logits, scale = rnd(2, 128, dtype=torch.float32), rnd(128, dtype=torch.float32).abs()
    gu, dn = rnd(16, 2 * 64, 256, scale=0.05), rnd(16, 256, 64, scale=0.05)
    tw, ti = torch.rand(2, 8, device=dev, generator=g), torch.randint(0, 16, (2, 8), device=dev, generator=g)
    xm = rnd(2, 256)
    q4 = [w4a16_gemm.quantize_nvfp4(rnd(n, k, scale=0.02, dtype=torch.float32)) for n, k in ((8192, 4096), (5376, 2816))]
    counter = w4a16_gemm.new_split_counter(8192, dev)
    merge_counter = paged_decode.new_merge_counter(2, 2, dev)

    def qkv_cache(p):
        cache.zero_()
        q, _, _ = qk_norm_rope.qkv_norm_rope_split(q_raw, k_raw, v_raw, nw[:256], nw[256:512], cos, sin, 1e-6,
                                                   (cache, *slots), pdl=p)  # fmt: skip
        return q, cache.clone()

    return [
        ("gemv", lambda p: gemv.gemv(x, w, gemv.GEMV_TILES[1], pdl=p)),
        ("gemv/preload2", lambda p: gemv.gemv(x, w, gemv.GEMV_PRELOAD_CANDIDATES[2], pdl=p)),
        ("rmsnorm", lambda p: rmsnorm.rmsnorm(h, nw, 1e-6, residual=res, pdl=p)),
        ("sandwich", lambda p: rmsnorm.sandwich_rmsnorm(h, res, nw, 1e-6, next_weights=[nw, nw], pdl=p)),
        ("gelu_mul_cat", lambda p: gelu_mul.gelu_mul_cat(qkv[:, : 2 * 704], pdl=p)),
        ("qk_norm_rope", lambda p: qk_norm_rope.qk_norm_rope(q_raw, nw[:256], cos, sin, 1e-6, pdl=p)),
        ("qkv_norm_rope_split/cache", qkv_cache),
        ("paged_decode/splits", lambda p: paged_decode.paged_decode_attention(
            qd, pcache, ind, ptr, lens, window=64, num_splits=4, pdl=p)),  # fmt: skip
        ("paged_decode/fused_merge", lambda p: paged_decode.paged_decode_attention(
            qd, pcache, ind, ptr, lens, window=64, num_splits=4, pdl=p, merge_counter=merge_counter)),  # fmt: skip
        ("moe_routing", lambda p: moe.moe_routing(logits, 8, scale, pdl=p)),
        ("fused_moe/gather", lambda p: moe.fused_moe(xm, gu, dn, tw, ti, path="gather", pdl=p)),
        ("w4a16_gemm/tc", lambda p: w4a16_gemm.w4a16_gemm(qkv[:1, :4096], *q4[0][:2], q4[0][2], config=w4a16_gemm.GEMV_TC_CONFIG, split_counter=counter, pdl=p)),  # fmt: skip
        ("w4a16_gemm/wide", lambda p: w4a16_gemm.w4a16_gemm(x, *q4[1][:2], q4[1][2], config=w4a16_gemm.GEMV_WIDE_DEEP_CONFIG, pdl=p)),  # fmt: skip
        ("stream_fold", lambda p: stream.stream_fold(qkv.view(torch.int32).flatten(), pdl=p)),
        ("fp8_gemv", lambda p: fp8_gemv.fp8_gemv(x, w.to(torch.float8_e4m3fn), scale[:1].expand(4224).contiguous(), config=fp8_gemv.GEMV_CONFIG, pdl=p)),  # fmt: skip
        ("fp8_gemv/tc", lambda p: fp8_gemv.fp8_gemv(qkv[:, :2816], w.to(torch.float8_e4m3fn), scale[:1].expand(4224).contiguous(), config=fp8_gemv.GEMV_TC_CONFIG, split_counter=counter, pdl=p)),  # fmt: skip
    ]


@pytest.mark.gpu
@gpu
def test_gpu_launchers_are_bit_identical_with_pdl():
    if not pdl.pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+")
    for name, fn in _launchers("cuda"):
        a, b = fn(False), fn(True)
        a, b = (a if isinstance(a, (tuple, list)) else (a,)), (b if isinstance(b, (tuple, list)) else (b,))
        flat = [(u, v) for s, t in zip(a, b, strict=True) for u, v in
                (zip(s, t, strict=True) if isinstance(s, list) else [(s, t)])]  # fmt: skip
        assert all(torch.equal(u, v) for u, v in flat), name


@pytest.mark.gpu
@gpu
def test_gpu_pdl_chain_in_a_graph_matches_plain():
    """A captured chain of dependent PDL launches (gemv -> sandwich -> gemv ...) replays to the plain chain's
    bits: each kernel waited for its input."""
    if not pdl.pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [(torch.randn(2816, 2816, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(6)]
    nw = torch.randn(2816, device="cuda", generator=g).bfloat16()
    x0 = torch.randn(1, 2816, device="cuda", generator=g).bfloat16()

    def chain(p):
        h = x = x0
        for w in ws:
            y = gemv.gemv(x, w, gemv.GEMV_TILES[1], pdl=p)
            h, (x,) = rmsnorm.sandwich_rmsnorm(y, h, nw, 1e-6, next_weights=[nw], pdl=p)
        return h

    want = chain(False)
    chain(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def _gpu_prompts(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    return [[rng.randint(3, min(vocab, 250_000) - 1) for _ in range(rng.randint(1, 200))] for _ in range(n)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", ["tiny", "31b", "26b-a4b", "31b-nvfp4", "31b-fp8"])
def test_gpu_engine_tokens_identical_with_pdl(preset):
    """Real widths with 2 layers (tiny: its own), FlashInfer + CUDA graphs + the fused path, decode_gemv=triton
    (every batch-1 linear a PDL launch), the Triton decode (max_batch_size 8), staggered lengths (mixed steps,
    then batch-1 tails): pdl on gives the same tokens as off, and so does switching it on a live engine.
    31b-nvfp4 / 31b-fp8: quantised weights, whose batch-1 products are the W4A16 tensor-core gemv / the FP8 GEMV
    (PDL launches too)."""
    if not pdl.pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+")
    name, scheme = {"31b-nvfp4": ("31b", "nvfp4"), "31b-fp8": ("31b", "fp8")}.get(preset, (preset, None))
    cfg = get_preset(name) if name == "tiny" else get_preset(name, num_layers=2)
    if name == "tiny":  # the real head dims (cached FlashInfer modules)
        cfg = cfg.replace(name="tiny-fi", head_dim=256, global_head_dim=512, sliding_window=16)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    if scheme:
        from perfkit.runtime.quant import quantize_model_

        quantize_model_(model, scheme)
    reqs = _gpu_prompts(12, seed=23, vocab=cfg.vocab_size)
    kw = dict(attention="flashinfer", cuda_graphs=True, page_size=16, max_batch_size=8, max_num_tokens=512,
              num_kv_pages=2000, max_model_len=1024, mask="triton", fused_kernels=True, decode_gemv="triton")  # fmt: skip

    def run(e):
        rids = [e.add_request(p, max_new_tokens=8 + (i % 5) * 6) for i, p in enumerate(reqs)]
        got = e.generate_all()
        e.bm.check_no_leaks()
        return [got[r] for r in rids]

    outs = [run(Engine(model, cfg, EngineConfig(**kw, pdl=p))) for p in (False, True)]
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("pdl", "on")
    assert live.toggles()["pdl"] == "on" and model.pdl
    outs.append(run(live))
    assert outs[0] == outs[1] == outs[2]
