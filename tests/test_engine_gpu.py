"""GPU engine tests (H200): FlashInfer backend vs the torch paged reference, CUDA graphs on vs off, multimodal
prefill with a custom mask, sync counts of the page-table builders inside a real decode loop.

The fused decoder layer (fused_kernels=on) is checked the same way (FlashInfer + graphs vs the torch backend).

Comparison in lockstep (see `lockstep`): a float32 twin of the model on the torch backend is the reference; a bf16
baseline (torch backend, or graphs off) sets the scale of bf16 noise; the candidate (FlashInfer, graphs on) must be
no further from float32 than 1.5x the baseline + 0.05, and pick the same token wherever the reference's top-2
margin is clear of that bound. All engines get the same requests, the same schedule and the reference's tokens.
Run: pytest -m gpu tests/test_engine_gpu.py -v -s
"""

import copy
import random
import warnings

import pytest
import torch

from perfkit.runtime.engine import Engine, EngineConfig
from perfkit.runtime.model_config import get_preset
from perfkit.runtime.weights import build_model

try:
    import flashinfer  # noqa: F401

    HAVE_FI = True
except ImportError:
    HAVE_FI = False

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_FI, reason="needs CUDA and flashinfer"),
]
_MODELS: dict = {}
_FP32: dict = {}


def model_for(name: str):
    if name not in _MODELS:
        if name == "tiny-fi":  # tiny with the real head dims (cached FlashInfer JIT modules), bidirectional vision
            cfg = get_preset("tiny").replace(name="tiny-fi", head_dim=256, global_head_dim=512, sliding_window=16)
        else:
            cfg = get_preset("31b", num_layers=2)
        _MODELS.clear()
        torch.cuda.empty_cache()
        _MODELS[name] = (cfg, build_model(cfg, "cuda", torch.bfloat16, seed=0))
    return _MODELS[name]


def engine(model, cfg, attention, graphs, **kw):
    # decode_io as `perfkit run` defaults it (fused: the graphs' one upload, decode_rows and softcap_argmax)
    base = dict(attention=attention, cuda_graphs=graphs, page_size=16, max_batch_size=64, max_num_tokens=512,
                num_kv_pages=3000, max_model_len=4096, mask="triton", decode_io=True)  # fmt: skip
    base.update(kw)
    return Engine(model, cfg, EngineConfig(**base))


def prompts(n: int, seed: int, vocab: int, long_every: int = 0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(1, 200)
        if long_every and i % long_every == 0:
            length = rng.randint(1100, 1500)  # beyond a 1024 window: sliding pages get freed
        out.append([rng.randint(3, min(vocab, 250_000) - 1) for _ in range(length)])
    return out


def fp32_twin(name: str):
    """The same weights in float32 (a copy of the bf16 model upcast): the accuracy anchor for bf16 backends."""
    key = name + ":fp32"
    if key not in _FP32:
        cfg, model = model_for(name)
        _FP32.clear()
        twin = copy.deepcopy(model).float()
        twin.setup_rope(model.rope.max_positions if model.rope is not None else None)
        _FP32[key] = twin
    return _FP32[key]


def lockstep(ref, base, cand, reqs, max_new: int):
    """Three engines on one schedule: `ref` (float32, torch backend) gives the tokens fed to all; `base` and `cand`
    are bf16 engines. Per step, cand's max logit error against ref must stay within 1.5x base's error + 0.05
    (bf16 noise of the reference implementation sets the scale), and cand's argmax must equal ref's wherever
    ref's top-2 margin exceeds twice that bound. Returns stats."""
    engines = [ref, base, cand]
    for e in engines:
        for ids, kw in reqs:
            e.add_request(ids, max_new_tokens=max_new, **kw)
    stats = {"steps": 0, "err_base": 0.0, "err_cand": 0.0, "tokens": 0, "graph_steps": 0}
    while ref.has_unfinished():
        scheds = [e.scheduler.schedule() for e in engines]
        shape = [[(c.req.request_id, c.start, c.num_tokens) for c in s.chunks] for s in scheds]
        assert all(s == shape[0] for s in shape), "schedules diverged"
        logits = []
        for e, s in zip(engines, scheds, strict=True):
            inp = e.runner.prepare(s)
            stats["graph_steps"] += inp.meta.graph_batch_size is not None
            logits.append(e.runner.forward(inp).float())
        lr, lb, lc = logits
        tokens = lr.argmax(-1)
        if lr.numel():  # a step of prefill chunks that sample nothing has no logits
            err_b = (lb - lr).abs().max().item()
            err_c = (lc - lr).abs().max().item()
            stats["err_base"] = max(stats["err_base"], err_b)
            stats["err_cand"] = max(stats["err_cand"], err_c)
            bound = 1.5 * err_b + 0.05
            assert err_c <= bound, f"step {stats['steps']}: error {err_c:.4f} vs fp32 > bound {bound:.4f}"
            top2 = lr.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
            assert bool((lc.argmax(-1) == tokens)[clear].all()), f"step {stats['steps']}: argmax differs"
        toks = tokens.tolist()
        stats["tokens"] += len(toks)
        for e, s in zip(engines, scheds, strict=True):
            e.scheduler.postprocess(s, toks, 0)
        stats["steps"] += 1
    for e in engines:
        e.bm.check_no_leaks()
    print(stats)
    return stats


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("bs", [1, 3, 8, 17, 64])
def test_flashinfer_matches_torch_tiny(graphs, bs):
    cfg, model = model_for("tiny-fi")
    reqs = [(p, {}) for p in prompts(bs, seed=bs, vocab=cfg.vocab_size)]
    st = lockstep(engine(fp32_twin("tiny-fi"), cfg, "torch", False), engine(model, cfg, "torch", False),
                  engine(model, cfg, "flashinfer", graphs), reqs, 32)  # fmt: skip
    if graphs:
        assert st["graph_steps"] > 0


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("bs", [1, 4, 17, 64])
def test_flashinfer_matches_torch_31b_2layers(graphs, bs):
    cfg, model = model_for("31b")
    reqs = [(p, {}) for p in prompts(bs, seed=bs, vocab=cfg.vocab_size, long_every=8)]
    st = lockstep(engine(fp32_twin("31b"), cfg, "torch", False), engine(model, cfg, "torch", False),
                  engine(model, cfg, "flashinfer", graphs), reqs, 32)  # fmt: skip
    if graphs:
        assert st["graph_steps"] > 0


@pytest.mark.parametrize("name", ["tiny-fi", "31b"])
def test_cuda_graphs_on_vs_off(name):
    cfg, model = model_for(name)
    reqs = [(p, {}) for p in prompts(24, seed=7, vocab=cfg.vocab_size)]
    lockstep(engine(fp32_twin(name), cfg, "torch", False), engine(model, cfg, "flashinfer", False),
             engine(model, cfg, "flashinfer", True), reqs, 32)  # fmt: skip


@pytest.mark.parametrize("name", ["tiny-fi", "31b"])
def test_fused_kernels_flashinfer_graphs_match_torch(name):
    """fused_kernels=on with FlashInfer and CUDA graphs (merged qkv / gate_up GEMMs, the qkv kernel writing K/V
    straight into the paged cache through kv_write_target at the graphs' static slot buffers, the next layer's
    input_layernorm folded into the last sandwich) against the unfused torch backend, in lockstep."""
    cfg, model = model_for(name)
    ref = engine(fp32_twin(name), cfg, "torch", False)
    base = engine(model, cfg, "torch", False)
    fused_model = copy.deepcopy(model)  # the fused flag is per model: the baseline stays unfused
    cand = engine(fused_model, cfg, "flashinfer", True, fused_kernels=True)
    reqs = [(p, {}) for p in prompts(12, seed=13, vocab=cfg.vocab_size)]
    st = lockstep(ref, base, cand, reqs, 16)
    assert st["graph_steps"] > 0
    assert all(layer.self_attn.merged_weight() is not None for layer in fused_model.layers)
    assert all(layer.mlp.merged_weight() is not None for layer in fused_model.layers)


@pytest.mark.parametrize("name", ["tiny-fi", "31b"])
@pytest.mark.parametrize("mode", ["triton", "auto"])
def test_decode_gemv_batch1_graphs_match_torch(name, mode):
    """decode_gemv (one-row linears through perfkit's gemv: every plain weight with triton, the timed winners with
    auto) with FlashInfer, CUDA graphs and the fused path, one request, so every decode step is a batch-1 graph
    replay of one-row products. The baseline is the same engine on cuBLAS (decode_gemv=cublas): the fused path's
    own distance from the torch reference is test_fused_kernels_flashinfer_graphs_match_torch's business."""
    cfg, model = model_for(name)
    ref = engine(fp32_twin(name), cfg, "torch", False)
    base = engine(copy.deepcopy(model), cfg, "flashinfer", True, fused_kernels=True, decode_gemv="cublas")
    cand = engine(copy.deepcopy(model), cfg, "flashinfer", True, fused_kernels=True, decode_gemv=mode)
    shapes = cand.stats.decode_gemv["shapes"]
    assert shapes and (mode == "triton" or all("cublas_us" in r for r in shapes.values()))
    st = lockstep(ref, base, cand, [(p, {}) for p in prompts(1, seed=21, vocab=cfg.vocab_size)], 24)
    assert st["graph_steps"] > 0


@pytest.mark.parametrize("name", ["tiny-fi", "31b"])
def test_overlap_on_vs_off_identical_tokens(name):
    """Overlapped steps change only when the host waits: the same batches, kernels and graphs run, so the tokens
    are bit-identical (decodes read their input ids from the previous step's sampled ids on the device), with
    CUDA graphs, the fused path and mixed prefill + decode steps (staggered max_new_tokens)."""
    cfg, model = model_for(name)
    fused_model = copy.deepcopy(model)
    reqs = prompts(20, seed=17, vocab=cfg.vocab_size)
    outs = []
    for overlap in (False, True):
        e = engine(fused_model, cfg, "flashinfer", True, fused_kernels=True, overlap=overlap)
        rids = [e.add_request(p, max_new_tokens=8 + (i % 5) * 6) for i, p in enumerate(reqs)]
        got = e.generate_all()
        outs.append([got[r] for r in rids])
        assert not e.has_unfinished()
        e.bm.check_no_leaks()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_tensor_cores_flag(tensor_cores):
    cfg, model = model_for("31b")
    reqs = [(p, {}) for p in prompts(8, seed=3, vocab=cfg.vocab_size)]
    lockstep(engine(fp32_twin("31b"), cfg, "torch", False), engine(model, cfg, "torch", False),
             engine(model, cfg, "flashinfer", True, decode_use_tensor_cores=tensor_cores), reqs, 16)  # fmt: skip


def mm_requests(cfg, n: int, seed: int, soft: int):
    rng = random.Random(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [2] + [rng.randint(3, 400) for _ in range(rng.randint(1, 30))] + [cfg.boi_token_id]
        ids += [cfg.image_token_id] * soft + [cfg.eoi_token_id] + [rng.randint(3, 400) for _ in range(5)]
        emb = torch.randn(soft, cfg.hidden_size, generator=g, device="cuda", dtype=torch.bfloat16)
        out.append((ids, {"mm_items": [emb]}))
    return out


@pytest.mark.parametrize("name,soft", [("tiny-fi", 40), ("31b", 280)])
def test_multimodal_prefill_custom_mask(name, soft):
    cfg, model = model_for(name)
    reqs = mm_requests(cfg, 5, seed=1, soft=soft) + [(p, {}) for p in prompts(3, seed=2, vocab=cfg.vocab_size)]
    # a small token budget forces chunked prefill aligned to the image blob, mixed with decodes
    budget = soft + 40
    lockstep(engine(fp32_twin(name), cfg, "torch", False, max_num_tokens=budget),
             engine(model, cfg, "torch", False, max_num_tokens=budget),
             engine(model, cfg, "flashinfer", True, max_num_tokens=budget), reqs, 16)  # fmt: skip


def test_decode_step_sync_count_host_vs_padded():
    """Device->host syncs per decode step, whole engine step (sampling's .tolist() is one of them)."""
    cfg, model = model_for("31b")
    counts = {}
    for mode in ("host", "padded"):
        e = engine(model, cfg, "flashinfer", True, page_table=mode)
        for p in prompts(32, seed=5, vocab=cfg.vocab_size):
            e.add_request(p, max_new_tokens=40)
        for _ in range(8):  # prefill + warm decode
            e.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(10):
                    e.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[mode] = sum("synchroniz" in str(w.message) for w in rec) / 10
    print("syncs per decode step:", counts)
    assert counts["host"] < counts["padded"]
