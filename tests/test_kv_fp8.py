"""FP8 (e4m3) KV cache: per-cache-layer K/V scales from the RMSNorm bound, quantised on the page write, dequantised
by the torch backend (CPU tests here) or folded into FlashInfer's run() (GPU tests at the bottom).

What e4m3 allows: 3 mantissa bits, so one rounding costs at most 2^-4 = 6.25 % of an element (RMS ~2.5-3 % measured
on K/V) while the value stays above the subnormal range; the RMSNorm-bound scale never saturates.

Measured on CPU (torch backend, tiny presets, 6 prompts x 16 tokens, teacher-forced lockstep; `_lockstep` below):
- one attention call, fp8 KV vs the same call on full-precision KV (every layer, prefill and decode, sliding
  window, KV-shared layers; tiny-e2b): output relative error max 4.6 %, mean 2.5 % with tempered q (below);
  max 15 %, mean 5 % for the model as built (near-hard softmax, see below). Asserted (tempered) < 2^-4.
- whole model, "tempered" tiny (q_norm weight = hd^-0.5, i.e. the usual 1/sqrt(hd) softmax temperature): logits
  relative error (Frobenius, worst step) 6.9 % (float32 model) / 7.2 % (bf16 model), ~ sqrt(6 layers) x 3 %;
  argmax agreement with the full-precision-KV engine 91 % / 91 % (the tiny random model's median top-2 logit
  margin is ~0.03 of a ~0.7 logit range, so argmax is fragile). Asserted: error < 12 %, agreement >= 75 %.
- whole model, random tiny as built (unit q/k norms, scale 1.0: attention logits have std ~sqrt(hd), so the
  softmax is near-hard and amplifies K rounding layer after layer): logits error 55 % / 55 %, argmax agreement
  54 % / 43 % (float32 / bf16 model);
  a bf16 model vs its float32 twin is already at 21 % / 86 % there. Not asserted (chaotic, not a KV property).
- exactness: a float32 model on fp8 KV gives the same logits (max |diff| < 1e-5) as the float32-KV engine whose
  k/v are fake-quantised with the same scales before the write.
"""

import random

import pytest
import torch
import yaml
from typer.testing import CliRunner

from perfkit.cli import app
from perfkit.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8_per_tensor, quantize_fp8_per_tensor
from perfkit.results import read_result
from perfkit.runtime.attention.torch_paged import TorchPagedBackend, read_kv, write_kv
from perfkit.runtime.engine import Engine, EngineConfig
from perfkit.runtime.kv_cache import PagedKVCache, plan_kv_pages
from perfkit.runtime.model_config import get_preset
from perfkit.runtime.weights import build_model

E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa: the largest relative rounding error of one e4m3 value


def _model(name: str, dtype: torch.dtype, tempered: bool = False):
    cfg = get_preset(name)
    model = build_model(cfg, "cpu", dtype, seed=0)
    if tempered:  # q_norm weight hd^-0.5: attention logits like a 1/sqrt(hd)-scaled softmax (trained-model regime)
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.q_norm.weight.fill_(layer.self_attn.layer.head_dim**-0.5)
    return cfg, model


def _engine(model, cfg, **over) -> Engine:
    kw = dict(attention="torch", page_size=4, max_batch_size=8, max_num_tokens=24, num_kv_pages=200,
              cuda_graphs=False, mask="dense", max_model_len=512)  # fmt: skip
    kw.update(over)
    return Engine(model, cfg, EngineConfig(**kw))


def _prompts(n: int = 6, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randint(3, 499) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def _lockstep(ref: Engine, cand: Engine, prompts, max_new: int = 16) -> dict:
    """Both engines on one schedule, fed ref's greedy tokens. Returns worst-step relative logits error
    (Frobenius), worst absolute error and the fraction of sampled rows whose argmax agrees."""
    for e in (ref, cand):
        for p in prompts:
            e.add_request(p, max_new_tokens=max_new)
    rel = absmax = 0.0
    agree = rows = 0
    while ref.has_unfinished():
        sr, sc = ref.scheduler.schedule(), cand.scheduler.schedule()
        assert [(c.req.request_id, c.start, c.num_tokens) for c in sr.chunks] == [
            (c.req.request_id, c.start, c.num_tokens) for c in sc.chunks
        ]
        lr = ref.runner.forward(ref.runner.prepare(sr)).float()
        lc = cand.runner.forward(cand.runner.prepare(sc)).float()
        if lr.numel():
            rel = max(rel, ((lc - lr).norm() / lr.norm()).item())
            absmax = max(absmax, (lc - lr).abs().max().item())
            agree += int((lc.argmax(-1) == lr.argmax(-1)).sum())
            rows += lr.shape[0]
        toks = lr.argmax(-1).tolist()
        ref.scheduler.postprocess(sr, toks, 0)
        cand.scheduler.postprocess(sc, toks, 0)
    for e in (ref, cand):
        e.bm.check_no_leaks()
    return {"rel": rel, "abs": absmax, "agree": agree / rows, "rows": rows}


# ---- quantisation primitives -----------------------------------------------------------------------------------


def test_per_tensor_roundtrip_is_within_half_an_ulp_and_saturates():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    scale = 16.0 / FP8_MAX  # the hd-256 v bound
    q = quantize_fp8_per_tensor(x, scale)
    assert q.dtype == FP8_DTYPE
    back = dequantize_fp8_per_tensor(q, scale, torch.float32)
    normal = x.abs() > scale * 2.0**-6  # e4m3's smallest normal, in x units
    assert ((back - x).abs() <= E4M3_REL * x.abs() + 1e-12)[normal].all()
    assert ((back - x).abs() <= scale * 2.0**-10)[~normal].all()  # subnormal step 2^-9: half of it
    big = quantize_fp8_per_tensor(torch.tensor([1e6, -1e6]), 1.0)  # saturates instead of inf/nan
    assert big.float().tolist() == [FP8_MAX, -FP8_MAX]


def test_write_then_read_pages_dequantises_with_the_layer_scale():
    cache = torch.zeros(3, 2, 4, 2, 8, dtype=FP8_DTYPE)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    page, off = torch.tensor([1, 1, 1, 1, 2]), torch.tensor([0, 1, 2, 3, 0])
    write_kv(cache, page, off, k, v, k_scale=0.01, v_scale=0.02)
    kr = read_kv(cache[torch.tensor([1, 2]), 0].reshape(-1, 2, 8)[:5], 0.01, torch.float32)
    vr = read_kv(cache[torch.tensor([1, 2]), 1].reshape(-1, 2, 8)[:5], 0.02, torch.float32)
    assert torch.allclose(kr, k, rtol=E4M3_REL, atol=0.01 * 2.0**-9)
    assert torch.allclose(vr, v, rtol=E4M3_REL, atol=0.02 * 2.0**-9)
    assert cache[0].float().abs().sum() == 0  # the dummy page is untouched


# ---- scales, memory ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny-e2b"])
def test_scales_are_the_rmsnorm_bound_and_are_recorded(name):
    cfg, model = _model(name, torch.float32)
    with torch.no_grad():
        model.layers[0].self_attn.k_norm.weight[3] = -2.5  # the bound follows max |w|
    e = _engine(model, cfg, kv_dtype="fp8")
    for la in cfg.attn_layers():
        ks, vs = e.kv.layer_scales(la.index)
        src = cfg.attn_layers()[la.cache_layer]  # KV-shared layers read their cache layer's scales
        wmax = model.layers[src.index].self_attn.k_norm.weight.abs().max().item()
        assert ks == pytest.approx(src.head_dim**0.5 * wmax / FP8_MAX)
        assert vs == pytest.approx(src.head_dim**0.5 / FP8_MAX)
    st = e.stats
    assert st.kv_dtype == "float8_e4m3fn"
    assert st.kv_scales["method"] == "rmsnorm_bound"
    assert st.kv_scales["layers"] == sum(la.writes_kv for la in cfg.attn_layers())
    assert st.kv_scales["k_max"] == pytest.approx(32**0.5 * 2.5 / FP8_MAX)
    assert st.kv_scales["v_min"] == pytest.approx(32**0.5 / FP8_MAX)
    base = _engine(model, cfg).stats
    assert base.kv_dtype == "float32" and base.kv_scales == {}


def test_real_k_and_v_never_reach_the_bound():
    """The bound is an upper bound on what the model writes: nothing is clamped."""
    cfg, model = _model("tiny", torch.bfloat16)
    e = _engine(model, cfg, kv_dtype="fp8")
    be = e.runner.backend
    worst = []
    inner = be.attend

    def attend(layer, q, k, v):
        if k is not None:
            ks, vs = e.kv.layer_scales(layer.index)
            worst.append(max(k.float().abs().max().item() / (ks * FP8_MAX), v.float().abs().max().item() / (vs * FP8_MAX)))
        return inner(layer, q, k, v)

    be.attend = attend
    for p in _prompts():
        e.add_request(p, max_new_tokens=4)
    e.generate_all()
    assert worst and max(worst) <= 1.0


def test_fp8_pool_holds_twice_the_pages_for_the_same_bytes():
    cfg = get_preset("tiny")
    budget = 64 << 20
    bf = plan_kv_pages(budget, 1.0, cfg, 16, torch.bfloat16)
    f8 = plan_kv_pages(budget, 1.0, cfg, 16, FP8_DTYPE)
    for pool in bf.num_pages:
        assert f8.bytes_per_page[pool] * 2 == bf.bytes_per_page[pool]
        assert f8.num_pages[pool] in (2 * bf.num_pages[pool], 2 * bf.num_pages[pool] + 1)
    assert f8.total_bytes <= budget
    _, model = _model("tiny", torch.bfloat16)
    e_bf = _engine(model, cfg, num_kv_pages=None, kv_cache_bytes=budget)
    e_f8 = _engine(model, cfg, num_kv_pages=None, kv_cache_bytes=budget, kv_dtype="fp8")
    pages_bf, pages_f8 = e_bf.stats.kv_pages, e_f8.stats.kv_pages
    assert pages_f8["sliding"] == pages_bf["sliding"]  # capped at what the sliding pool can ever use (both)
    assert pages_f8["full"] >= 2 * pages_bf["full"]  # the full pool gets the rest: more than twice the pages
    assert sum(e_f8.stats.kv_pool_bytes.values()) <= budget
    assert all(t.dtype == FP8_DTYPE for t in e_f8.kv._tensors.values())


# ---- accuracy ------------------------------------------------------------------------------------------------


class _FakeQuantKV:
    """A full-precision-KV backend fed k/v that went through e4m3 with the fp8 engine's scales."""

    def __init__(self, inner: TorchPagedBackend, scales):
        self.inner, self.scales = inner, scales
        self.name, self.supports_cuda_graphs = inner.name, False

    def set_metadata(self, meta):
        self.inner.set_metadata(meta)

    def attend(self, layer, q, k, v):
        if k is not None:
            ks, vs = self.scales.k[layer.index], self.scales.v[layer.index]
            k = dequantize_fp8_per_tensor(quantize_fp8_per_tensor(k, ks), ks, k.dtype)
            v = dequantize_fp8_per_tensor(quantize_fp8_per_tensor(v, vs), vs, v.dtype)
        return self.inner.attend(layer, q, k, v)


@pytest.mark.parametrize("name", ["tiny", "tiny-e2b"])
def test_fp8_engine_equals_fake_quantised_reference(name):
    cfg, model = _model(name, torch.float32)
    cand = _engine(model, cfg, kv_dtype="fp8")
    ref = _engine(model, cfg)
    ref.runner.backend = _FakeQuantKV(ref.runner.backend, cand.kv_scales)
    st = _lockstep(ref, cand, _prompts())
    assert st["abs"] < 1e-5 and st["agree"] == 1.0, st


def test_attention_output_error_per_call_is_e4m3_sized():
    """Every attention call of the fp8 engine against the same call on a float32 shadow cache (same pages, same
    metadata): output relative error < 2^-4 (measured max 4.6 %, mean 2.5 %; tempered q, see the docstring)."""
    cfg, model = _model("tiny-e2b", torch.float32, tempered=True)
    e = _engine(model, cfg, kv_dtype="fp8")
    be = e.runner.backend
    shadow = TorchPagedBackend(PagedKVCache(e.layers, e.kv.num_pages, e.kv.page_size, torch.float32, "cpu"))
    errs = []
    set_meta, attend = be.set_metadata, be.attend

    def set_metadata(meta):
        set_meta(meta)
        shadow.set_metadata(meta)

    def attend_both(layer, q, k, v):
        out = attend(layer, q, k, v)
        ref = shadow.attend(layer, q, k, v)
        errs.append(((out - ref).norm() / ref.norm()).item())
        return out

    be.set_metadata, be.attend = set_metadata, attend_both
    for p in _prompts():
        e.add_request(p, max_new_tokens=8)
    e.generate_all()
    print(f"attention output rel err: max {max(errs):.4f} mean {sum(errs) / len(errs):.4f} over {len(errs)} calls")
    assert len(errs) > 100 and max(errs) < E4M3_REL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_logits_close_to_full_precision_kv(dtype):
    cfg, model = _model("tiny", dtype, tempered=True)
    st = _lockstep(_engine(model, cfg), _engine(model, cfg, kv_dtype="fp8"), _prompts())
    print(dtype, st)
    assert st["rows"] == 96
    assert st["rel"] < 0.12, st  # measured 0.069 (float32) / 0.072 (bf16); 6 layers of ~3 % e4m3 noise
    assert st["agree"] >= 0.75, st  # measured 0.906 / 0.906


def test_fp8_kv_untempered_random_model_is_measured_not_bounded():
    """The random model as built amplifies any perturbation (see the module docstring): the fp8 engine must run,
    finish every request and stay finite; its distance from full-precision KV is printed, not asserted."""
    cfg, model = _model("tiny", torch.bfloat16)
    st = _lockstep(_engine(model, cfg), _engine(model, cfg, kv_dtype="fp8"), _prompts())
    print(st)
    assert st["rows"] == 96 and st["rel"] == st["rel"]  # not NaN


# ---- perfkit run ---------------------------------------------------------------------------------------------


def test_perfkit_run_with_fp8_kv_records_dtype_and_scales(tmp_path):
    cfg = {
        "name": "kvfp8",
        "model": {"preset": "tiny", "dtype": "float32", "device": "cpu"},
        "runtime": {"max_batch_size": 8, "max_num_tokens": 256, "max_model_len": 1024},
        "toggles": {"attention": "torch"},
        "scenarios": [{"name": "a", "workload": {"isl": 12, "osl": 3}, "arrival": {"concurrency": 2},
                       "num_requests": 2}],
    }  # fmt: skip
    p = tmp_path / "kv.yaml"
    p.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r"), "--set", "runtime.kv_dtype=fp8"])
    assert res.exit_code == 0, res.output
    result = read_result(next((tmp_path / "r").iterdir()))
    (s,) = result.scenarios
    assert s.status == "ok" and s.counts.output_tokens == 6
    assert result.config["runtime"]["kv_dtype"] == "fp8"
    assert s.runtime["kv_dtype"] == "float8_e4m3fn"
    assert s.runtime["kv_scales"]["method"] == "rmsnorm_bound" and s.runtime["kv_scales"]["k_max"] > 0


# ---- GPU: FlashInfer fp8 KV against the torch fp8 KV reference (H200) ------------------------------------------


def _have_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or not _have_flashinfer(), reason="needs CUDA and flashinfer"
)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("bs", [1, 17])
@pytest.mark.gpu
@needs_flashinfer
def test_flashinfer_fp8_kv_matches_torch_fp8_kv_31b_2layers(graphs, bs):
    """Lockstep of test_engine_gpu: reference = float32 twin on the torch backend with float32 KV; baseline = the
    bf16 model on the torch backend with fp8 KV (sets the error scale, fp8 noise included); candidate = FlashInfer
    with fp8 KV. The candidate must stay within 1.5x the baseline's error + 0.05 and agree on clear argmaxes."""
    from test_engine_gpu import engine, fp32_twin, lockstep, model_for, prompts

    cfg, model = model_for("31b")
    reqs = [(p, {}) for p in prompts(bs, seed=bs, vocab=cfg.vocab_size, long_every=8)]
    base = engine(model, cfg, "torch", False, kv_dtype="fp8")
    cand = engine(model, cfg, "flashinfer", graphs, kv_dtype="fp8")
    assert cand.kv.dtype == FP8_DTYPE and cand.kv_scales == base.kv_scales
    st = lockstep(engine(fp32_twin("31b"), cfg, "torch", False), base, cand, reqs, 32)
    if graphs:
        assert st["graph_steps"] > 0


@pytest.mark.gpu
@needs_flashinfer
def test_flashinfer_fp8_kv_graphs_on_vs_off_31b_2layers():
    from test_engine_gpu import engine, fp32_twin, lockstep, model_for, prompts

    cfg, model = model_for("31b")
    reqs = [(p, {}) for p in prompts(24, seed=7, vocab=cfg.vocab_size)]
    lockstep(engine(fp32_twin("31b"), cfg, "torch", False), engine(model, cfg, "flashinfer", False, kv_dtype="fp8"),
             engine(model, cfg, "flashinfer", True, kv_dtype="fp8"), reqs, 32)  # fmt: skip
