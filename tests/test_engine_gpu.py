"""GPU engine tests (H200): FlashInfer backend vs the torch paged reference, CUDA graphs on vs off, multimodal
prefill with a custom mask, sync counts of the page-table builders inside a real decode loop.

Comparison in lockstep: two engines get the same requests and (same config, same pages) the same schedule every
step; both forward, the reference's argmax is fed to both, so every step is compared on identical inputs. Tokens
must agree wherever the reference's top-2 logit margin exceeds 2 * LOGIT_ATOL, and logits must stay within
LOGIT_ATOL (bf16 kernels differ in summation order; exact token equality on near-ties is not a property either
kernel has). Run: pytest -m gpu tests/test_engine_gpu.py -v -s
"""

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
LOGIT_ATOL = 0.25  # bf16 logits of magnitude 16-32 are quantised in steps of 0.125; kernels differ by ~1-2 ulp
LOGIT_RTOL = 0.02  # of the largest |logit| of the step (soft-capped at 30): bf16 noise through the layers
_MODELS: dict = {}


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
    base = dict(attention=attention, cuda_graphs=graphs, page_size=16, max_batch_size=64, max_num_tokens=512,
                num_kv_pages=3000, max_model_len=4096, mask="triton")  # fmt: skip
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


def lockstep(engines, reqs, max_new: int):
    """reqs: list of (ids, kwargs). Returns stats; asserts per-step agreement with engines[0]."""
    for e in engines:
        for ids, kw in reqs:
            e.add_request(ids, max_new_tokens=max_new, **kw)
    stats = {"steps": 0, "max_diff": 0.0, "tokens": 0, "argmax_disagree": 0, "graph_steps": 0}
    while engines[0].has_unfinished():
        scheds = [e.scheduler.schedule() for e in engines]
        shape = [[(c.req.request_id, c.start, c.num_tokens) for c in s.chunks] for s in scheds]
        assert all(s == shape[0] for s in shape), "schedules diverged"
        logits = []
        for e, s in zip(engines, scheds, strict=True):
            inp = e.runner.prepare(s)
            stats["graph_steps"] += inp.meta.graph_batch_size is not None
            logits.append(e.runner.forward(inp).float())
        ref = logits[0]
        tokens = ref.argmax(-1)
        if ref.numel():  # a step of prefill chunks that sample nothing has no logits
            tol = max(LOGIT_ATOL, LOGIT_RTOL * ref.abs().max().item())
            top2 = ref.topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            for other in logits[1:]:
                diff = (other - ref).abs().max().item()
                stats["max_diff"] = max(stats["max_diff"], diff)
                assert diff < tol, f"step {stats['steps']}: logits differ by {diff} (tol {tol:.3f})"
                agree = other.argmax(-1) == tokens
                assert bool(agree[margin > 2 * tol].all()), f"step {stats['steps']}: argmax differs"
                stats["argmax_disagree"] += int((~agree).sum())
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
    st = lockstep([engine(model, cfg, "torch", False), engine(model, cfg, "flashinfer", graphs)], reqs, 32)
    if graphs:
        assert st["graph_steps"] > 0


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("bs", [1, 4, 17, 64])
def test_flashinfer_matches_torch_31b_2layers(graphs, bs):
    cfg, model = model_for("31b")
    reqs = [(p, {}) for p in prompts(bs, seed=bs, vocab=cfg.vocab_size, long_every=8)]
    st = lockstep([engine(model, cfg, "torch", False), engine(model, cfg, "flashinfer", graphs)], reqs, 32)
    if graphs:
        assert st["graph_steps"] > 0


@pytest.mark.parametrize("name", ["tiny-fi", "31b"])
def test_cuda_graphs_on_vs_off(name):
    cfg, model = model_for(name)
    reqs = [(p, {}) for p in prompts(24, seed=7, vocab=cfg.vocab_size)]
    lockstep([engine(model, cfg, "flashinfer", False), engine(model, cfg, "flashinfer", True)], reqs, 32)


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_tensor_cores_flag(tensor_cores):
    cfg, model = model_for("31b")
    reqs = [(p, {}) for p in prompts(8, seed=3, vocab=cfg.vocab_size)]
    lockstep([engine(model, cfg, "torch", False),
              engine(model, cfg, "flashinfer", True, decode_use_tensor_cores=tensor_cores)], reqs, 16)  # fmt: skip


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
    lockstep([engine(model, cfg, "torch", False, max_num_tokens=soft + 40),
              engine(model, cfg, "flashinfer", True, max_num_tokens=soft + 40)], reqs, 16)  # fmt: skip


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
