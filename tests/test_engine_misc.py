"""Small engine pieces on CPU: FlashInfer missing is a clear PerfkitError, toggles validation, KV sizing."""

import pytest
import torch

from perfkit.errors import PerfkitError
from perfkit.runtime.cuda_graphs import graph_batch_sizes
from perfkit.runtime.engine import Engine, EngineConfig, _warmup_prefill_tokens
from perfkit.runtime.kv_cache import bytes_per_page, plan_kv_pages, pool_specs
from perfkit.runtime.model_config import get_preset
from perfkit.runtime.weights import build_model


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]


def test_warmup_prefill_sizes_cover_both_divisibility_classes_at_three_scales():
    """The KV-sizing warmup prefills n, n // 8 and 64 tokens, each in both multiple-of-16 classes (Triton
    specialises integer arguments on it), so neither the largest chunk's kernels, nor those of the quantised MoE's
    sorted path (below dequant_min_pairs), nor the sorted GEMMs' decode tiles (257-1024 pairs) compile inside a
    measured window; then the row counts of the quantised linears' own kernel forms (the dot path's 128-row tile,
    the tensor-core gemv's 16-row groups, each in both classes); small n gives no size below 1 and no repeats."""
    assert _warmup_prefill_tokens(8192) == [8192, 8191, 1024, 1023, 64, 63, 143, 128, 32, 31, 15]
    assert _warmup_prefill_tokens(4095) == [4095, 4080, 511, 496, 64, 63, 143, 128, 32, 31, 15]
    assert _warmup_prefill_tokens(64) == [64, 63, 8, 32, 31, 15]
    assert _warmup_prefill_tokens(8) == [8, 1]
    assert _warmup_prefill_tokens(1) == [1]
    for n in range(1, 300):
        sizes = _warmup_prefill_tokens(n)
        assert sizes[0] == n and all(1 <= t <= n for t in sizes) and len(set(sizes)) == len(sizes)
        for m in (n, n // 8, 64 if n > 64 else 0):
            if m >= 16:  # m itself and a size of the other class within 16 tokens below it
                assert m in sizes and any((t % 16 == 0) != (m % 16 == 0) for t in sizes if m - 16 < t <= m)


def test_logits_into_a_buffer_are_bit_identical():
    """The decode graphs' shared logits buffer: model.logits(h, out=) writes the same fp32 soft-capped values in
    place (and returns the buffer) as the allocating path."""
    model = build_model(get_preset("tiny"), "cpu", torch.float32, seed=0)
    assert model.cfg.final_logit_softcapping  # the in-place div / tanh / mul path is exercised
    h = torch.randn(5, model.cfg.hidden_size)
    buf = torch.full((8, model.cfg.vocab_size), float("nan"))
    out = model.logits(h, out=buf[:5])
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, model.logits(h))
    assert buf[5:].isnan().all()


def test_bytes_per_page_31b():
    cfg = get_preset("31b")
    specs = pool_specs(cfg.attn_layers())
    # gemma4.md §2.7: sliding 16 KiB / token / layer x 50 layers, full 8 KiB x 10 layers (bf16, K+V)
    assert bytes_per_page(specs["sliding"], 16, torch.bfloat16) == 16 * 16 * 1024 * 50
    assert bytes_per_page(specs["full"], 16, torch.bfloat16) == 16 * 8 * 1024 * 10
    plan = plan_kv_pages(100 << 30, 0.9, cfg, 16, torch.bfloat16, max_batch_size=64, max_num_tokens=8192)
    assert plan.total_bytes <= 0.9 * (100 << 30)
    assert plan.num_pages["sliding"] == 64 * (64 + 2) + 512 + 1  # capped at what the sliding pool can use
    kv_shared = pool_specs(get_preset("e2b").attn_layers())
    assert len(kv_shared["sliding"].cache_layers) == 12 and len(kv_shared["full"].cache_layers) == 3


def test_flashinfer_missing_or_no_cuda_is_a_perfkit_error():
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32)
    with pytest.raises(PerfkitError, match="flashinfer"):
        Engine(model, cfg, EngineConfig(attention="flashinfer", num_kv_pages=64, page_size=4, max_model_len=256))
    eng = Engine(model, cfg, EngineConfig(attention="torch", num_kv_pages=64, page_size=4, max_model_len=256))
    with pytest.raises(PerfkitError, match="allowed"):
        eng.set_toggle("page_table", "sideways")
    with pytest.raises(PerfkitError, match="max_model_len"):
        eng.add_request([5] * 200, max_new_tokens=100)


def test_warm_up_prefills_once_per_toggle_state_and_leaves_the_engine_idle():
    """Engine.warm_up runs the sizing warmup's prefills on the live engine when its toggle state has not run them
    (an A/B arm's toggles launch other kernel forms), frees every page they took, leaves the engine's generation
    unchanged, and refuses while requests are running."""
    from perfkit.runtime.generate import greedy_generate

    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    ec = EngineConfig(attention="torch", num_kv_pages=64, page_size=4, max_model_len=128, max_num_tokens=48)
    eng = Engine(model, cfg, ec)
    free = {pool: eng.bm.num_free(pool) for pool in eng.kv.specs}
    assert eng.warm_up() == _warmup_prefill_tokens(48)
    assert not eng.has_unfinished() and {pool: eng.bm.num_free(pool) for pool in eng.kv.specs} == free
    assert eng.warm_up() == []  # this state is warm
    eng.set_toggle("mask", "triton" if ec.mask == "dense" else "dense")
    assert eng.warm_up() == _warmup_prefill_tokens(48)
    eng.set_toggle("mask", ec.mask)
    assert eng.warm_up() == []
    prompt = [2, *range(30, 45)]
    rid = eng.add_request(prompt, max_new_tokens=6)
    eng.set_toggle("page_table", "padded" if ec.page_table == "host" else "host")
    with pytest.raises(PerfkitError, match="idle engine"):
        eng.warm_up()
    got = []
    while eng.has_unfinished():
        got += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert got == greedy_generate(model, prompt, 6)
