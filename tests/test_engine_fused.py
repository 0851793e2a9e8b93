"""The fused decoder layer (`fused_kernels=on`) in the model and the serving engine, CPU (Triton under
TRITON_INTERPRET=1): merged q|k|v and gate|up weights are views (one copy of the weights, names and loading
unchanged), the engine with the torch paged backend matches the unfused model step for step (logits to fp32
summation order, identical greedy tokens, the same KV cache contents) with K/V written by the qkv kernel straight
into the cache, in mixed prefill + decode batches; toggling on a live engine, quantised projections (separate
GEMMs), fp8 KV caches (the kernel quantises with the layer's scales) and weights replaced after merging all keep
working.

Tolerances: fp32 io. The fused kernels compute in fp32 with one rounding and another summation order than the
PyTorch ops, so logits agree to max |diff| <= 3e-5 x max |logit| (measured here <= 7.9e-6; <= 1.4e-5 on longer
runs and tiny-e4b) and K/V cache entries (normed, |x| ~ 1) to 1e-4 (measured <= 1.8e-5; <= 2.7e-5 on longer runs).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from isolation import in_fresh_process

from perfkit.kernels.w4a16_gemm import repack_words
from perfkit.runtime.engine import Engine, EngineConfig
from perfkit.runtime.generate import greedy_generate
from perfkit.runtime.model import Gemma4Attention, Gemma4MLP
from perfkit.runtime.model_config import get_preset
from perfkit.runtime.quant import Fp8Linear, Nvfp4Linear, quantize_model_
from perfkit.runtime.weights import build_model

PRESETS = ["tiny", "tiny-moe", "tiny-e2b"]  # dense K=V, MoE, PLE + KV sharing + full layers with a v_proj


def _model(name: str, seed: int = 0):
    cfg = get_preset(name)
    return cfg, build_model(cfg, "cpu", torch.float32, seed=seed)


def _engine(model, cfg, fused: bool, **over) -> Engine:
    kw = dict(attention="torch", page_size=4, max_batch_size=8, max_num_tokens=10, num_kv_pages=200,
              cuda_graphs=False, mask="dense", max_model_len=256, fused_kernels=fused)  # fmt: skip
    kw.update(over)
    return Engine(model, cfg, EngineConfig(**kw))


def _prompts(n: int = 3, seed: int = 3, hi: int = 12):
    rng = random.Random(seed)
    return [[rng.randint(3, 499) for _ in range(rng.randint(1, hi))] for _ in range(n)]


class _WriteSpy:
    """Wraps a backend's attend: counts calls on KV-writing layers whose K/V the caller already wrote (k None)."""

    def __init__(self, backend):
        self.direct = self.handed = 0
        inner = backend.attend

        def attend(layer, q, k, v):
            if layer.writes_kv:
                self.direct += k is None
                self.handed += k is not None
            return inner(layer, q, k, v)

        backend.attend = attend


def _lockstep(ref: Engine, cand: Engine, prompts, max_new: int = 4) -> dict:
    """Both engines on one schedule (the reference's tokens fed to both): per step the candidate's logits must be
    within 3e-5 x max |logit| of the reference's and pick the same tokens. Returns stats."""
    for e in (ref, cand):
        for p in prompts:
            e.add_request(p, max_new_tokens=max_new)
    st = {"steps": 0, "mixed": 0, "rel": 0.0}
    while ref.has_unfinished():
        sr, sc = ref.scheduler.schedule(), cand.scheduler.schedule()
        assert [(c.req.request_id, c.start, c.num_tokens) for c in sr.chunks] == [
            (c.req.request_id, c.start, c.num_tokens) for c in sc.chunks
        ]
        st["mixed"] += 0 < sr.num_decodes < len(sr.chunks)
        lr, lc = ref.runner.forward(ref.runner.prepare(sr)), cand.runner.forward(cand.runner.prepare(sc))
        toks = lr.argmax(-1).tolist()
        if lr.numel():
            rel = ((lc - lr).abs().max() / lr.abs().max()).item()
            st["rel"] = max(st["rel"], rel)
            assert rel <= 3e-5, f"step {st['steps']}: logits differ by {rel:.2e} x max |logit|"
            assert lc.argmax(-1).tolist() == toks, f"step {st['steps']}: greedy tokens differ"
        for e, s in ((ref, sr), (cand, sc)):
            e.scheduler.postprocess(s, toks, 0)
        st["steps"] += 1
    for e in (ref, cand):
        e.bm.check_no_leaks()
    return st


# ---- merged weights ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "tiny-e2b", "tiny-e4b"])
def test_merged_projections_are_views_of_one_tensor(name):
    cfg, model = _model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    model.set_fused(True)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects, re-pointed
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    for layer, la in zip(model.layers, cfg.attn_layers(), strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        if not la.writes_kv:  # KV-shared: only q_proj, nothing to merge
            assert attn.merged_weight() is None
        else:
            parts = [attn.q_proj, attn.k_proj] + ([] if attn.v_proj is None else [attn.v_proj])
            assert (attn.v_proj is None) == cfg.layer_k_eq_v(la.index)
            rows = (la.num_heads + la.num_kv_heads * (1 if attn.v_proj is None else 2)) * la.head_dim
            assert attn.merged_weight().shape == (rows, cfg.hidden_size)
            assert torch.equal(attn.merged_weight(), torch.cat([p.weight for p in parts]))
            storage = attn.merged_weight().untyped_storage().data_ptr()
            assert all(p.weight.untyped_storage().data_ptr() == storage for p in parts)  # no second copy
        assert mlp.merged_weight().shape == (2 * mlp.gate_proj.out_features, cfg.hidden_size)
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.merged_weight().untyped_storage().data_ptr()
    assert not any(n.endswith(("qkv", "gate_up")) for n in model.state_dict())
    # loading (in-place copy_, as load_state_dict and the HF loader do) keeps the views and lands in the merged tensor
    attn = model.layers[0].self_attn
    ptr = attn.q_proj.weight.data_ptr()
    new = {k: torch.randn_like(v) if v.dim() == 2 else v for k, v in before.items()}
    model.load_state_dict(new)
    assert attn.q_proj.weight.data_ptr() == ptr and attn.merged_weight() is not None
    assert torch.equal(attn.merged_weight()[: attn.q_proj.out_features], new["layers.0.self_attn.q_proj.weight"])
    model.set_fused(False)  # the unfused path reads the same storage
    assert attn.merged_weight() is not None and attn.q_proj.weight.data_ptr() == ptr


def test_weights_replaced_after_merging_fall_back_then_merge_again():
    cfg, model = _model("tiny")
    prompt = _prompts(1)[0]
    ref = greedy_generate(model, prompt, 3)
    model.set_fused(True)
    model.to(torch.float64)  # every Parameter gets new storage: the merged fp32 tensors are stale
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.merged_weight() is None and mlp.merged_weight() is None  # dropped (freed), separate GEMMs
    model.to(torch.float32).setup_rope()
    assert greedy_generate(model, prompt, 3) == ref  # the fallback path
    model.set_fused(True)
    assert attn.merged_weight() is not None and mlp.merged_weight() is not None  # merged again
    assert greedy_generate(model, prompt, 3) == ref


# ---- engine: fused vs unfused --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS)
def test_engine_fused_matches_unfused(name):
    """Torch paged backend, chunked prefill mixed with decodes: fused logits / tokens / KV cache = unfused."""
    cfg, model = _model(name)
    fused_model = copy.deepcopy(model)  # the fused flag is per model: one model per engine
    ref, cand = _engine(model, cfg, False), _engine(fused_model, cfg, True)
    spy = _WriteSpy(cand.runner.backend)
    st = _lockstep(ref, cand, _prompts())
    assert st["mixed"] > 0  # some steps held decodes and prefill chunks together
    writers = sum(la.writes_kv for la in cfg.attn_layers())
    assert spy.direct == writers * st["steps"] and spy.handed == 0  # every KV write went through the kernel
    assert all(
        layer.self_attn.merged_weight() is not None for layer in fused_model.layers if layer.self_attn.layer.writes_kv
    )
    for li, t in ref.kv._tensors.items():
        torch.testing.assert_close(cand.kv._tensors[li], t, atol=1e-4, rtol=1e-4)


def test_fused_toggle_on_live_engine_gives_the_reference_tokens():
    """on -> off -> on -> off on one engine between steps (CPU: no graphs to recapture) = the unfused greedy tokens."""
    cfg, model = _model("tiny")
    prompts = _prompts(3, seed=5)
    want = [greedy_generate(model, p, 8) for p in prompts]
    eng = _engine(model, cfg, True)
    rids = [eng.add_request(p, max_new_tokens=8) for p in prompts]
    out: dict[int, list[int]] = {}
    arms, k = ["off", "on", "off", "on"], 0
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if k < len(arms):
            eng.set_toggle("fused_kernels", arms[k])
            assert model.fused == (arms[k] == "on") and eng.toggles()["fused_kernels"] == arms[k]
            k += 1
    assert k == len(arms)
    assert [out[r] for r in rids] == want
    assert model.layers[0].self_attn.merged_weight() is not None


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_quantized_projections_merge_and_run_fused(scheme):
    """Fp8Linear / Nvfp4Linear q|k|v and gate|up merge into one quantised GEMM each (row views, per-row global
    scales for NVFP4), then the same one qkv kernel launch; tokens equal the unfused quantised model's."""
    cfg, model = _model("tiny")
    quantize_model_(model, scheme)
    for m in model.modules():  # W8A8's per-token activation rounding turns fp32-ulp differences into e4m3 steps
        if isinstance(m, Fp8Linear):
            m.quantize_input = False
    q_fused = copy.deepcopy(model)
    q_fused.set_fused(True)
    merged = [
        m for m in q_fused.modules() if isinstance(m, (Gemma4Attention, Gemma4MLP)) and m.merged_weight() is not None
    ]
    assert merged and all(type(m.qkv if isinstance(m, Gemma4Attention) else m.gate_up).__name__ == "MergedQuantRows"
                          for m in merged)  # fmt: skip
    mlp = q_fused.layers[0].mlp
    assert mlp.gate_proj.weight.data_ptr() == mlp.merged_weight().data_ptr()  # a view: the weight exists once
    ref, cand = _engine(model, cfg, False), _engine(q_fused, cfg, True)
    spy = _WriteSpy(cand.runner.backend)
    _lockstep(ref, cand, _prompts(2), max_new=3)
    assert spy.direct > 0 and spy.handed == 0  # the qkv kernel still writes K/V into the cache


def test_fp8_kv_cache_written_by_the_qkv_kernel():
    """fp8 pools: the write target carries the layer's K/V scales and the qkv kernel quantises into the cache
    itself (no k, v handed to attend); tokens and cache bytes as the unfused model's backend write."""
    cfg, model = _model("tiny")
    fused_model = copy.deepcopy(model)
    ref, cand = _engine(model, cfg, False, kv_dtype="fp8"), _engine(fused_model, cfg, True, kv_dtype="fp8")
    spy = _WriteSpy(cand.runner.backend)
    prompts = _prompts(3)
    for e in (ref, cand):
        for p in prompts:
            e.add_request(p, max_new_tokens=4)
    a, b = ref.generate_all(), cand.generate_all()
    assert spy.direct > 0 and spy.handed == 0
    layer = cfg.attn_layers()[0]
    target = cand.runner.backend.kv_write_target(layer)  # the last step's metadata
    assert target[0].dtype == torch.float8_e4m3fn and target[3:] == cand.kv.layer_scales(layer.index)
    # both round K/V to e4m3; fused vs unfused K/V differ by fp32 ulps, which can flip an e4m3 rounding, and the
    # (chaotic) random tiny model amplifies a flip: held to mostly equal tokens and cache bytes
    same = sum(x == y for r in a for x, y in zip(a[r], b[r], strict=True))
    assert same >= 0.75 * sum(len(t) for t in a.values()), (a, b)
    for li, t in ref.kv._tensors.items():
        equal = (cand.kv._tensors[li].view(torch.uint8) == t.view(torch.uint8)).float().mean().item()
        assert equal > 0.9, (li, equal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_merging_returns_the_replaced_weights_to_the_driver(request):
    """The KV pool is sized from the driver's free memory: the q/k/v and gate/up tensors replaced by the merged
    ones must not stay in torch's cache (they did: 31B's pool lost ~20 GB and requests were preempted)."""
    if not in_fresh_process(request):  # reserved memory / a budget: the allocator's state matters
        return
    cfg = get_preset("31b", num_layers=2)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # baseline: what the weights themselves hold
    before = torch.cuda.memory_reserved()
    model.set_fused(True)  # replaces 2 x (176 MB q|k|v + 462 MB gate|up) of separate tensors
    grown = torch.cuda.memory_reserved() - before
    assert grown < 64 << 20, f"{grown / 2**20:.0f} MiB more reserved after merging"
    assert all(layer.mlp.merged_weight() is not None for layer in model.layers)


@pytest.mark.parametrize("fused", [True, False])
def test_nvfp4_repacked_words_give_the_same_tokens(fused):
    """Toggle w4a16_words: "repacked" rewrites every NVFP4 weight in place (a merged q|k|v / gate|up weight and the
    separate modules that view its rows alike) and the engine's logits equal the standard words' bit for bit; the
    summary per fused-path shape is in the stats; switched live to "standard" the checkpoint's words are back, and
    "auto" repacks nothing off CUDA (no tensor-core gemv)."""
    cfg, model = _model("tiny")
    quantize_model_(model, "nvfp4")
    std = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _engine(copy.deepcopy(model), cfg, fused)
    cand = _engine(model, cfg, fused, w4a16_words="repacked")
    mods = [m for m in model.modules() if isinstance(m, Nvfp4Linear)]
    attn = model.layers[0].self_attn
    assert mods and all(m.repacked for m in mods) and cand.toggles()["w4a16_words"] == "repacked"
    assert torch.equal(attn.q_proj.weight, repack_words(std["layers.0.self_attn.q_proj.weight"]))
    assert not fused or attn.qkv.module.repacked
    assert set(cand.stats.w4a16_words.values()) == {"repacked"} and set(ref.stats.w4a16_words.values()) == {
        "standard"
    }
    assert all(torch.equal(v, std[k]) for k, v in model.state_dict().items())  # checkpoints see standard words
    assert _lockstep(ref, cand, _prompts(2), max_new=3)["rel"] == 0.0
    cand.set_toggle("w4a16_words", "standard")
    assert not any(m.repacked for m in mods) and torch.equal(attn.q_proj.weight, std["layers.0.self_attn.q_proj.weight"])
    cand.set_toggle("w4a16_words", "auto")
    assert not any(m.repacked for m in mods) and cand.toggles()["w4a16_words"] == "auto"
