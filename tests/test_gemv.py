"""The bf16 / fp16 GEMV (perfkit.kernels.gemv) and toggle decode_gemv: the Triton kernel against its fp32 reference
(tails in N and K, several rows of x, every candidate tile, evict-first), argument and tile checks, the traffic
formula, the tile rule; the model's routing (which weights, which shapes, batch-1 rows only, the LM head) and the
engine toggle, on CPU under TRITON_INTERPRET=1 (tests/conftest.py). GPU tests (real 31B / 26B-A4B shapes, the
timed choice) skip without CUDA.

Tolerance (and why): kernel and reference multiply the same values in fp32 and differ by the order of the K-term
sums (each within K * 2^-24 * sum |terms|), plus the output's one rounding to x's dtype. Elementwise bound:
``2 * (K + 4) * 2^-24 * sum_k |x_k * w_nk| + ulp(out dtype) * |ref|``.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("triton")

import perfkit.kernels.gemv as gv  # noqa: E402
from perfkit.errors import PerfkitError  # noqa: E402
from perfkit.kernels.gemv import (  # noqa: E402
    GEMV_TILES,
    INTERPRETER_TILE,
    GemvConfig,
    default_tile,
    gemv,
    gemv_ref,
    gemv_traffic,
    tile_by_label,
)
from perfkit.runtime import model as model_mod  # noqa: E402
from perfkit.runtime.attention.contiguous import ContiguousAttention  # noqa: E402
from perfkit.runtime.engine import TOGGLES, Engine, EngineConfig  # noqa: E402
from perfkit.runtime.model_config import get_preset  # noqa: E402
from perfkit.runtime.weights import build_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _assert_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = gemv_ref(x, w).double()
    terms = (x.double().abs() @ w.double().abs().t())  # sum_k |x_k w_nk|
    K = x.shape[1]
    bound = 2 * (K + 4) * 2.0**-24 * terms + ULP[out.dtype] * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert bool((err <= bound).all()), f"max err {err.max().item():.3e}, max (err / bound) {(err / bound).max():.2f}"


def _operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) * 0.02).to(dtype)
    return x.to(DEVICE), w.to(DEVICE)


# ---- the kernel --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 40, 208), (1, 16, 64), (3, 40, 208), (5, 7, 30), (1, 1, 1)])
def test_gemv_matches_the_reference(M, N, K, dtype):
    """Partial N tiles (40 rows in 16-row tiles), a K tail (208 = 3 x 64 + 16), K below one step (30), rows of x
    past one program's four (M = 5), and no full step at all (K = 1)."""
    x, w = _operands(M, N, K, dtype, seed=M * 100 + N)
    for cfg in (GemvConfig(16, 64, 4), GemvConfig(16, 64, 4, evict_first=True), INTERPRETER_TILE,
                GemvConfig(16, 64, 4, preload=2)):  # fmt: skip
        _assert_close(gemv(x, w, cfg), x, w)


def test_gemv_writes_into_out_and_takes_row_strided_x():
    x, w = _operands(2, 24, 96, torch.bfloat16)
    big = torch.zeros(2, 200, dtype=x.dtype, device=DEVICE)
    big[:, 10:106] = x  # x as a row-strided view (stride 200, unit along K)
    out = torch.full((2, 24), float("nan"), dtype=x.dtype, device=DEVICE)
    assert gemv(big[:, 10:106], w, GemvConfig(8, 32, 4), out=out) is out
    _assert_close(out, x, w)


def test_gemv_one_hot_rows_pick_single_weights_exactly():
    """One-hot x: each output is one weight value (no accumulation to differ in), bit for bit."""
    _, w = _operands(1, 33, 80, torch.bfloat16)
    x = torch.zeros(3, 80, dtype=torch.bfloat16, device=DEVICE)
    for r, k in enumerate((0, 47, 79)):
        x[r, k] = 1.0
        assert torch.equal(gemv(x[r : r + 1], w, GemvConfig(16, 32, 4))[0], w[:, k])
    assert torch.equal(gemv(x, w, GemvConfig(16, 32, 4)), w[:, [0, 47, 79]].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 40, 208), (3, 17, 30), (1, 33, 2112)])
def test_gemv_glu_is_gelu_mul_then_gemv_bit_for_bit(M, N, K, dtype):
    """glu=True reads the (gate | up) halves of a row-strided [M, 2K] view (a merged gate_up output with more
    columns after it) and gives exactly gemv(gelu_mul_cat(x), w): the same rounded input, the same sums."""
    from perfkit.kernels.gelu_mul import gelu_mul_cat

    gen = torch.Generator().manual_seed(K)
    wide = torch.randn(M, 2 * K + 7, generator=gen).to(dtype).to(DEVICE)
    x = wide[:, : 2 * K]
    _, w = _operands(M, N, K, dtype, seed=N)
    for cfg in (GemvConfig(16, 64, 4), GemvConfig(8, 32, 2, preload=2), INTERPRETER_TILE):
        out = gemv(x, w, cfg, glu=True)
        assert torch.equal(out, gemv(gelu_mul_cat(x), w, cfg))
        ref = gemv_ref(x, w, glu=True)
        assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-6
    with pytest.raises(ValueError, match="do not match"):
        gemv(x[:, :K], w, glu=True)  # glu takes both halves


@pytest.mark.parametrize("N2", [128, 7])
def test_gemv_pair_is_two_gemvs_bit_for_bit(N2):
    """Two independent products in one launch (the MoE router beside the dense gate_up): each output equals its
    own gemv exactly, whatever the second product's rows (partial last block, fewer rows than one block)."""
    x, w = _operands(1, 72, 96, torch.bfloat16, seed=1)
    x2, w2 = _operands(1, N2, 96, torch.bfloat16, seed=2)
    for cfg in (GemvConfig(16, 32, 4), GemvConfig(32, 64, 4, preload=2)):
        a, b = gv.gemv_pair(x, w, x2, w2, cfg)
        assert torch.equal(a, gemv(x, w, cfg)) and torch.equal(b, gemv(x2, w2, cfg))
    with pytest.raises(ValueError, match="do not match"):
        gv.gemv_pair(x, w, x2[:, :64], w2[:, :64])  # K differs
    with pytest.raises(ValueError, match="rows"):
        gv.gemv_pair(x, w, x2.expand(2, -1), w2)


@pytest.mark.parametrize("M,E,top_k", [(1, 128, 8), (1, 16, 4), (3, 32, 2)])
def test_gemv_routed_is_gemv_then_routing(M, E, top_k):
    """One more program routes the logits: the product equals gemv's (plain and GLU) and the routing weights and
    expert ids equal moe_routing's, bit for bit under the interpreter. Several tiles, so the routing program follows
    1..N/4 product programs along axis 0; M = 3 has more than one program along axis 1 (tile rows of 1-4)."""
    from perfkit.kernels.moe import moe_routing

    x, w = _operands(M, 40, 96, torch.bfloat16, seed=3)
    xg, _ = _operands(M, 40, 192, torch.bfloat16, seed=6)  # [M, 2K]: gate | up for glu
    logits = torch.randn(M, E, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16) * 4  # [M, E], few ties
    scale = torch.rand(E, generator=torch.Generator().manual_seed(5)) + 0.5
    ref_w, ref_idx = moe_routing(logits, top_k, scale)
    for cfg in (GemvConfig(4, 32, 2), GemvConfig(16, 64, 4), GemvConfig(32, 64, 4, preload=2)):
        for xx, glu in ((x, False), (xg, True)):
            out, rw, ridx = gv.gemv_routed(xx, w, logits, top_k, scale, cfg, glu=glu)
            assert torch.equal(out, gemv(xx, w, cfg, glu=glu))
            assert torch.equal(rw, ref_w) and torch.equal(ridx, ref_idx)
    with pytest.raises(ValueError, match="top_k"):
        gv.gemv_routed(x, w, logits, E + 1, scale)
    with pytest.raises(ValueError, match="logits"):
        gv.gemv_routed(x, w, logits[:1].expand(M + 1, -1), top_k, scale)


_SM90_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from perfkit.kernels import gemv as gv

ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "N2", "n_blocks1", "stride_x2m", "stride_w2n",
        "stride_o2m")
sig = {name: "*bf16" for name in ("x_ptr", "w_ptr", "out_ptr", "x2_ptr", "w2_ptr", "out2_ptr")} | dict.fromkeys(ints, "i32")
sig |= {"logits_ptr": "*bf16", "stride_lm": "i32", "E": "i32", "escale_ptr": "*fp32", "rw_ptr": "*fp32", "ridx_ptr": "*i32"}
rows = []
for glu, pair, preload, route in json.loads(sys.argv[1]):
    consts = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "EVICT": "evict_first", "PDL": 1, "PRELOAD": preload,
              "GLU": glu, "PAIR": pair, "ROUTE": route, "TOP_K": 8, "BLOCK_TK": 8, "BLOCK_E": 128}
    try:
        k = triton.compile(ASTSource(gv._gemv_kernel, sig | dict.fromkeys(consts, "constexpr"), consts),
                           target=GPUTarget("cuda", 90, 32))
        ptx = k.asm["ptx"]
        rows.append("griddepcontrol.wait" in ptx and "atom" not in ptx)
    except Exception as exc:
        rows.append(f"{type(exc).__name__}: {exc}"[:2000])
print(json.dumps(rows))
"""


def test_gemv_variants_compile_for_sm90():
    """Ahead-of-time compile for sm_90 (PTX and cubin, no GPU needed; a subprocess, outside the interpreter): the
    interpreter accepts code the compiler refuses (12-06: a variable whose type changed inside an ``if``), and
    PAIR reassigns the pointer arguments inside one. None needs an atomic (the routed form's program is independent)."""
    import json

    from aot import sm90_rows

    variants = [(0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (1, 0, 2, 0), (0, 1, 2, 0), (1, 0, 1, 1), (0, 0, 2, 1)]
    rows = sm90_rows(_SM90_COMPILE, json.dumps(variants))
    assert rows == [True] * len(variants), rows


def test_gemv_rejects_mismatched_operands():
    x, w = _operands(1, 8, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        gemv(x.float(), w)
    with pytest.raises(ValueError, match="do not match"):
        gemv(x[:, :16], w)
    with pytest.raises(ValueError, match="unit stride"):
        gemv(x, w.t().contiguous().t())
    assert gemv(x[:0], w).shape == (0, 8)


def test_tiles_and_their_rule(monkeypatch):
    with pytest.raises(ValueError, match="powers of two"):
        GemvConfig(12, 512, 4)
    with pytest.raises(ValueError, match="preload"):
        GemvConfig(16, 512, 4, preload=3)
    assert GemvConfig(16, 512, 4, True, preload=2).label == "16x512w4ep2"
    labels = [t.label for t in GEMV_TILES]
    assert len(set(labels)) == len(labels) and labels[0] == "16x512w4e"
    assert all(tile_by_label(t.label) is t for t in GEMV_TILES) and tile_by_label("cublas") is None
    assert default_tile(5376, 8192) is INTERPRETER_TILE  # under the interpreter: one wide tile
    monkeypatch.setattr(gv, "interpreting", lambda: False)
    assert default_tile(5376, 21504) is GEMV_TILES[0]  # long K
    assert default_tile(262144, 5376) is GEMV_TILES[3]  # the LM head
    assert default_tile(16384, 5376) is GEMV_TILES[2]


def test_traffic_formula():
    t = gemv_traffic(1, 5376, 8192)
    assert t["weight_bytes"] == 2 * 5376 * 8192
    assert t["total_bytes"] == 2 * (5376 * 8192 + 8192 + 5376)
    assert gemv_traffic(1, 2816, 2112, glu=True)["total_bytes"] == 2 * (2816 * 2112 + 2 * 2112 + 2816)
    assert t["bound_us"] == pytest.approx(t["total_bytes"] / 4.3e12 * 1e6)


def test_timing_needs_one_shape():
    with pytest.raises(ValueError, match="one shape"):
        gv.time_gemv_choice([torch.zeros(4, 8), torch.zeros(4, 16)])


# ---- the model's routing -----------------------------------------------------------------------------------
def _fused_model(name: str = "tiny"):
    cfg = get_preset(name)
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    model.set_fused(True)
    return cfg, model


def _forward(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One forward of a fresh sequence through the contiguous reference backend."""
    attn = ContiguousAttention()
    attn.prepare(ids.numel())
    return model(ids, pos, attn)


class _GemvSpy:
    """Counts the model's gemv calls by weight shape (the fused kernels' namespace is shared and cached)."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, int]] = []
        ns = model_mod._kernels()
        inner = ns.gemv

        def spy(x, w, tile):
            self.shapes.append(tuple(w.shape))
            return inner(x, w, tile)

        monkeypatch.setattr(ns, "gemv", spy)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-e2b"])
def test_decode_weights_are_what_the_fused_forward_multiplies(name, monkeypatch):
    """decode_weights groups the merged qkv / gate_up, o / down, the router, the PLE gates and the LM head; with
    decode_gemv=triton a one-token forward sends every one of them through the gemv, and its logits match cuBLAS's."""
    cfg, model = _fused_model(name)
    groups = model.decode_weights()
    H = cfg.hidden_size
    assert (cfg.vocab_size, H, torch.float32) in groups  # the tied LM head
    merged = [w for layer in model.layers for w in (layer.self_attn.merged_weight(), layer.mlp.merged_weight())]
    listed = {w.data_ptr() for ws in groups.values() for w in ws}
    assert all(w.data_ptr() in listed for w in merged if w is not None)  # merged rows, not their views
    calls = sum(len(ws) for ws in groups.values())
    ids, pos = torch.tensor([5]), torch.tensor([0])
    ref = _forward(model, ids, pos)
    summary = model.set_decode_gemv("triton")
    assert summary["mode"] == "triton" and set(summary["shapes"]) == {f"{n}x{k}" for n, k, _ in groups}
    spy = _GemvSpy(monkeypatch)
    out = _forward(model, ids, pos)
    assert len(spy.shapes) == calls  # every weight of every layer, and the LM head
    torch.testing.assert_close(out, ref, atol=3e-5 * ref.abs().max().item(), rtol=0)
    spy.shapes.clear()
    _forward(model, torch.tensor([5, 6]), torch.tensor([0, 1]))
    assert spy.shapes == []  # two rows: cuBLAS
    model.set_fused(False)
    _forward(model, ids, pos)
    assert spy.shapes == []  # the unfused path never routes


def test_set_decode_gemv_modes():
    cfg, model = _fused_model()
    assert model.set_decode_gemv("auto") == {"mode": "auto", "shapes": {}}  # no CUDA: nothing timed, cuBLAS
    assert not model.layers[0].mlp.gemv_tiles and not model.gemv_tiles
    model.set_decode_gemv("triton")
    assert model.layers[0].self_attn.gemv_tiles and model.gemv_tiles is model.layers[0].gemv_tiles
    twin = copy.deepcopy(model)  # the tables copy with the model (the GPU tests deepcopy engines' models)
    assert twin.layers[0].mlp.gemv_tiles == model.layers[0].mlp.gemv_tiles
    model.set_decode_gemv("cublas")
    assert not model.layers[0].self_attn.gemv_tiles
    with pytest.raises(ValueError, match="decode_gemv"):
        model.set_decode_gemv("fast")
    model.set_fused(False)
    assert model.set_decode_gemv("triton") == {"mode": "triton", "shapes": {}}  # the unfused path never routes
    assert not model.layers[0].mlp.gemv_tiles


# ---- the engine toggle -------------------------------------------------------------------------------------
def _prompts(n: int = 2, seed: int = 5):
    rng = random.Random(seed)
    return [[rng.randint(3, 499) for _ in range(rng.randint(2, 9))] for _ in range(n)]


def _generate(engine: Engine, prompts, max_new: int = 5) -> list[list[int]]:
    ids = [engine.add_request(p, max_new_tokens=max_new) for p in prompts]
    out = engine.generate_all()
    return [out[i] for i in ids]


def test_engine_toggle_gives_the_reference_tokens(monkeypatch):
    """One request at a time (batch-1 decode rows) and two at once: decode_gemv=triton gives cuBLAS's greedy tokens,
    switches on a live engine, and reports its choice in the stats."""
    cfg, model = _fused_model()
    kw = dict(attention="torch", page_size=4, max_batch_size=4, max_num_tokens=16, num_kv_pages=200,
              cuda_graphs=False, mask="dense", max_model_len=128, fused_kernels=True)  # fmt: skip
    assert TOGGLES["decode_gemv"] == ("auto", "cublas", "triton")
    ref_engine = Engine(copy.deepcopy(model), cfg, EngineConfig(**kw))
    assert ref_engine.stats.decode_gemv == {"mode": "cublas", "shapes": {}}
    prompts = _prompts()
    ref = [_generate(ref_engine, [p]) for p in prompts] + [_generate(ref_engine, prompts)]
    engine = Engine(model, cfg, EngineConfig(**kw, decode_gemv="triton"))
    assert engine.toggles()["decode_gemv"] == "triton" and engine.stats.decode_gemv["mode"] == "triton"
    spy = _GemvSpy(monkeypatch)
    assert [_generate(engine, [p]) for p in prompts] + [_generate(engine, prompts)] == ref
    assert spy.shapes  # the batch-1 decode steps went through the gemv
    engine.set_toggle("decode_gemv", "cublas")
    spy.shapes.clear()
    assert _generate(engine, prompts[:1]) == ref[0] and spy.shapes == []
    with pytest.raises(PerfkitError, match="decode_gemv"):
        Engine(model, cfg, EngineConfig(**kw, decode_gemv="fast"))


# ---- GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [(5376, 8192), (16384, 5376), (2816, 2112), (128, 2816)])
def test_gpu_gemv_real_shapes_every_tile(N, K):
    x, w = _operands(1, N, K, torch.bfloat16, seed=N)
    for cfg in GEMV_TILES + gv.GEMV_PRELOAD_CANDIDATES:
        _assert_close(gemv(x, w, cfg), x, w)
    row = gv.time_gemv_choice([w, w.clone()], calls=4, replays=3)
    assert set(row["tiles"]) == {t.label for t in GEMV_TILES} and row["cublas_us"] > 0
    assert row["best"] == "cublas" or row["best_us"] < row["cublas_us"]


@pytest.mark.gpu
@gpu
def test_gpu_auto_times_the_model_shapes_and_matches_cublas():
    """31B shapes with 2 layers (one sliding, one full): auto times every shape once and keeps its winners; a
    one-token forward agrees with the cuBLAS one to rounding."""
    cfg = get_preset("31b", num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    model.set_fused(True)
    ids, pos = torch.tensor([7], device="cuda"), torch.tensor([0], device="cuda")
    ref = _forward(model, ids, pos)
    summary = model.set_decode_gemv("auto")
    assert set(summary["shapes"]) == {f"{n}x{k}" for n, k, _ in model.decode_weights()}
    assert all(r["best"] == "cublas" or r["best_us"] < r["cublas_us"] for r in summary["shapes"].values())
    assert model.set_decode_gemv("auto")["shapes"] == summary["shapes"]  # timed once per model
    mlp = next(m for m in model.modules() if isinstance(m, model_mod.Gemma4MLP))
    for key in model._down_keys():  # the GLU form: timed on the down shape, taken only where it won
        glu = summary["shapes"][f"{key[0]}x{key[1]}"]["glu"]
        assert glu["best"] == "separate" or glu["best_us"] < glu["separate_us"]
        assert (key in mlp.glu_tiles) == (glu["best"] != "separate")
    model.set_decode_gemv("triton")
    out = _forward(model, ids, pos)
    torch.testing.assert_close(out, ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    assert (out.argmax(-1) == ref.argmax(-1)).all()


def test_sweep_cli_refuses_an_unknown_shape_prefix(capsys):
    assert gv._main(["--only", "70b"]) == 2
    assert "matches none of" in capsys.readouterr().out
