"""Toggle decode_moe_ffn=branches: a MoE layer's dense MLP on a second CUDA stream beside the routing and the experts
(perfkit/runtime/model.py, ``Gemma4DecoderLayer._ffn_branches``), the router's product in the attention sandwich.

CPU (TRITON_INTERPRET=1; no CUDA stream, so the two branches run in turn): which launches the model runs (spies),
its logits against the separate path's, the row limit and the other fallbacks, bad values, and the engine toggle.
GPU: on a real-width 2-layer 26B-A4B the side stream gives the serial order's outputs bit for bit (the same
kernels), a deep copy of the model shares the stream, and the engine's greedy tokens (FlashInfer, CUDA graphs, PDL)
equal the separate arm's, also switched live.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from test_decode_fusion import _forward, _model  # noqa: E402
from test_moe_ffn import CPU_ENGINE, _cpu_tokens, _gpu_engine_case, _Spy  # noqa: E402

from perfkit.errors import PerfkitError  # noqa: E402
from perfkit.runtime.engine import Engine, EngineConfig  # noqa: E402
from perfkit.runtime.model import FFN_BRANCH_MAX_ROWS  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("dtype", "rows"), [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 3)])
def test_model_runs_the_two_branches(dtype, rows, monkeypatch):
    """Up to FFN_BRANCH_MAX_ROWS rows: every MoE layer's sandwich carries the router, then one routing launch and
    one experts' call (no gemv_pair / gemv_routed / moe_ffn); the logits match the separate path's (fp32 to
    rounding; bf16 within a few ulps of the logits' scale), and so does the greedy token."""
    cfg, model = _model("tiny-moe", dtype)
    ids = torch.arange(5, 5 + rows)
    model.set_decode_fusion(True, routed=True)
    ref = _forward(model, ids)
    model.set_decode_fusion(True, routed=True, moe_ffn="branches")
    assert all(layer.decode_moe_ffn == "branches" and layer.ffn_stream is None for layer in model.layers)  # no CUDA
    spy = _Spy(monkeypatch)
    out = _forward(model, ids)
    L = cfg.num_hidden_layers
    assert spy.routers == L and spy.calls["moe_routing"] == L and spy.calls["fused_moe"] == L
    assert spy.calls["gemv_pair"] == spy.calls["gemv_routed"] == spy.calls["moe_ffn"] == 0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_fallbacks_keep_the_separate_launches(monkeypatch):
    """More rows than FFN_BRANCH_MAX_ROWS (a prefill), or decode_fusion off: the separate launches, logits bit for
    bit; a dense model has no branch to take; an unknown form is refused."""
    cfg, model = _model("tiny-moe")
    many = torch.arange(5, 6 + FFN_BRANCH_MAX_ROWS)
    model.set_decode_fusion(True, routed=True)
    ref = _forward(model, many)
    model.set_decode_fusion(True, routed=True, moe_ffn="branches")
    spy = _Spy(monkeypatch)
    assert torch.equal(_forward(model, many), ref) and spy.routers == 0
    model.set_decode_fusion(False, moe_ffn="branches")
    assert all(layer.decode_moe_ffn == "separate" for layer in model.layers)
    _forward(model, torch.tensor([5]))
    assert spy.routers == 0
    with pytest.raises(ValueError, match="allowed values are separate, fused, branches"):
        model.set_decode_fusion(True, moe_ffn="both")
    _, dense = _model("tiny")
    dense.set_decode_fusion(True, routed=True)
    one = torch.tensor([5])
    ref = _forward(dense, one)
    dense.set_decode_fusion(True, routed=True, moe_ffn="branches")
    assert torch.equal(_forward(dense, one), ref) and spy.routers == 0


def test_engine_tokens_and_live_switch():
    """An engine (torch attention, fused path) gives the separate arm's greedy tokens with decode_moe_ffn branches,
    also switched on a live engine (fp32: the arms agree to rounding); a bad value is one PerfkitError."""
    cfg, model = _model("tiny-moe")
    kw, run = CPU_ENGINE, _cpu_tokens
    off = run(Engine(copy.deepcopy(model), cfg, EngineConfig(**kw)))
    on = run(Engine(copy.deepcopy(model), cfg, EngineConfig(**kw, decode_moe_ffn="branches")))
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("decode_moe_ffn", "branches")
    assert live.toggles()["decode_moe_ffn"] == "branches" and model.layers[0].decode_moe_ffn == "branches"
    assert off == on == run(live)
    live.set_toggle("decode_moe_ffn", "fused")
    assert model.layers[0].decode_moe_ffn == "fused" and run(live) == off
    with pytest.raises(PerfkitError, match="decode_moe_ffn='both'; allowed: separate, fused, branches"):
        Engine(copy.deepcopy(model), cfg, EngineConfig(**kw, decode_moe_ffn="both"))


# ---- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_gpu_side_stream_is_the_serial_order_bit_for_bit():
    """Real-width 26B-A4B, 2 layers, bf16, the fused path with PDL: 1, 4 and 32 rows, the dense MLP on the side
    stream gives the logits of the same launches in turn on one stream, bit for bit; a deep copy of the model
    shares the side stream."""
    _, model, kw, _ = _gpu_engine_case(0)
    model.set_fused(True)
    model.set_pdl(kw["pdl"])
    model.set_decode_gemv("triton")
    model.set_decode_fusion(True, routed=True, moe_ffn="branches")
    side = model.layers[0].ffn_stream
    assert side is not None and all(layer.ffn_stream is side for layer in model.layers)
    assert copy.deepcopy(model).layers[0].ffn_stream is side
    for rows in (1, 4, FFN_BRANCH_MAX_ROWS):
        ids = torch.randint(3, 250_000, (rows,), device="cuda")
        got = _forward(model, ids)
        model._set_module_flag("ffn_stream", None)
        want = _forward(model, ids)
        model._set_module_flag("ffn_stream", side)
        torch.cuda.synchronize()
        assert torch.equal(got, want), rows


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("requests, max_batch", [(12, 8), (40, 32)])
def test_gpu_engine_tokens_with_the_branches(requests, max_batch):
    """FlashInfer + CUDA graphs (the branches captured as two graph branches) + the fused path + PDL, staggered
    lengths (mixed steps, then tails of 1 to max_batch rows; 32 = FFN_BRANCH_MAX_ROWS): decode_moe_ffn branches
    gives the separate arm's greedy tokens, also switched on a live engine."""
    cfg, model, kw, run = _gpu_engine_case(31, requests, max_batch)
    off = run(Engine(model, cfg, EngineConfig(**kw)))
    on = run(Engine(model, cfg, EngineConfig(**kw, decode_moe_ffn="branches")))
    live = Engine(model, cfg, EngineConfig(**kw))
    live.set_toggle("decode_moe_ffn", "branches")
    assert on == off and run(live) == off
