"""Engine on tiny configs (CPU, torch paged backend): exactly the greedy tokens of the dense model forward
(perfkit.runtime.generate), with staggered arrivals, chunked prefill, mixed batches, preemption, sliding-window
page freeing, multimodal chunks, and toggles switched on a live engine."""

import random

import pytest
import torch

from perfkit.runtime.engine import Engine, EngineConfig
from perfkit.runtime.generate import greedy_generate
from perfkit.runtime.model_config import get_preset
from perfkit.runtime.weights import build_model

_MODELS: dict = {}


def model_for(name: str):
    if name not in _MODELS:
        cfg = get_preset(name)
        _MODELS[name] = (cfg, build_model(cfg, "cpu", torch.float32, seed=0))
    return _MODELS[name]


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 40):
    rng = random.Random(seed)
    return [[rng.randint(3, 499) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_staggered(engine: Engine, prompts, max_new, arrivals, **kw):
    """Submit prompt i before step arrivals[i]; returns {prompt index: tokens}."""
    rid_of: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while len(rid_of) < len(prompts) or engine.has_unfinished():
        for i, p in enumerate(prompts):
            if i not in rid_of and arrivals[i] <= step:
                rid_of[i] = engine.add_request(p, max_new_tokens=max_new[i], **kw.get(i, {}))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
        assert step < 5000
    return {i: out[r] for i, r in rid_of.items()}


def cpu_engine(model, cfg, **over) -> Engine:
    kw = dict(
        attention="torch",
        page_size=4,
        max_batch_size=8,
        max_num_tokens=24,
        num_kv_pages=200,
        cuda_graphs=False,
        mask="dense",
        max_model_len=512,
    )
    kw.update(over)
    return Engine(model, cfg, EngineConfig(**kw))


@pytest.mark.parametrize("name", ["tiny", "tiny-e2b", "tiny-moe"])
def test_engine_matches_dense_greedy_with_staggered_arrivals(name):
    cfg, model = model_for(name)
    prompts = random_prompts(10, seed=3, hi=50)
    max_new = [random.Random(i).randint(1, 14) for i in range(len(prompts))]
    arrivals = [0, 0, 1, 2, 2, 3, 5, 8, 8, 13]
    eng = cpu_engine(model, cfg)
    got = run_staggered(eng, prompts, max_new, arrivals)
    for i, p in enumerate(prompts):
        assert got[i] == greedy_generate(model, p, max_new[i]), f"request {i}"
    eng.bm.check_no_leaks()
    assert not eng.bm.tables


def test_preemption_and_sliding_page_freeing_exact():
    cfg, model = model_for("tiny")  # sliding window 8, page_size 4
    prompts = random_prompts(8, seed=5, lo=20, hi=60)
    max_new = [30] * len(prompts)
    # full pool of 40 pages of 4 tokens cannot hold 8 x 90 tokens: preemption must happen
    eng = cpu_engine(model, cfg, num_kv_pages=40, max_num_tokens=16)
    got = run_staggered(eng, prompts, max_new, [0] * len(prompts))
    assert eng.stats.preemptions > 0
    for i, p in enumerate(prompts):
        assert got[i] == greedy_generate(model, p, max_new[i]), f"request {i}"
    eng.bm.check_no_leaks()


def test_long_sequence_holds_o_window_sliding_pages():
    cfg, model = model_for("tiny")
    eng = cpu_engine(model, cfg, num_kv_pages=400, max_num_tokens=8)
    p = random_prompts(1, seed=9, lo=100, hi=100)[0]
    rid = eng.add_request(p, max_new_tokens=40)
    peak_sliding = 0
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
        if eng.bm.tables:
            peak_sliding = max(peak_sliding, len(eng.bm.page_list(rid, "sliding").pages))
    # window 8, chunk <= 8, page 4: at most ceil((8 - 1 + 8) / 4) + 1 = 5 live sliding pages
    assert peak_sliding <= 5
    assert out == greedy_generate(model, p, 40)


def test_toggles_on_live_engine_give_identical_tokens():
    cfg, model = model_for("tiny")
    prompts = random_prompts(6, seed=11, hi=30)
    eng = cpu_engine(model, cfg)
    rids = [eng.add_request(p, max_new_tokens=12) for p in prompts]
    out: dict[int, list[int]] = {}
    arms = [("page_table", "padded"), ("page_table", "host"), ("mask", "triton"), ("mm_embed_cache", "off")]
    k = 0
    while eng.has_unfinished():
        if k < len(arms):
            eng.set_toggle(*arms[k])
            k += 1
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for r, p in zip(rids, prompts, strict=True):
        assert out[r] == greedy_generate(model, p, 12)


def mm_prompt(cfg, rng, n_images: int, soft: int):
    ids, types = [2], [0]
    for _ in range(n_images):
        ids += [rng.randint(3, 400) for _ in range(rng.randint(1, 6))] + [cfg.boi_token_id]
        types += [0] * (len(ids) - len(types))
        ids += [cfg.image_token_id] * soft
        types += [1] * soft
        ids += [cfg.eoi_token_id]
        types += [0]
    ids += [rng.randint(3, 400) for _ in range(4)]
    types += [0] * 4
    return ids, types


@pytest.mark.parametrize("cache", ["on", "off"])
def test_multimodal_chunked_prefill_matches_dense(cache):
    cfg, model = model_for("tiny")  # bidirectional vision on sliding layers, window 8
    rng = random.Random(4)
    g = torch.Generator().manual_seed(0)
    reqs = []
    for n_img, soft in [(1, 5), (2, 12), (1, 3)]:
        ids, types = mm_prompt(cfg, rng, n_img, soft)
        items = [torch.randn(soft, cfg.hidden_size, generator=g) * 0.5 for _ in range(n_img)]
        reqs.append((ids, types, items))
    eng = cpu_engine(model, cfg, max_num_tokens=10, mm_embed_cache=cache == "on")
    rids = [eng.add_request(ids, mm_items=items, max_new_tokens=8, token_type_ids=types)
            for ids, types, items in reqs]  # fmt: skip
    eng.add_request(random_prompts(1, seed=1)[0], max_new_tokens=20)  # a text request decoding alongside
    out = eng.generate_all()
    for r, (ids, types, items) in zip(rids, reqs, strict=True):
        ref = greedy_generate(model, ids, 8, mm_embeds=torch.cat(items), token_type_ids=types)
        assert out[r] == ref


@pytest.mark.parametrize("cache", ["on", "off"])
def test_pixel_items_batched_through_the_vision_tower(cache):
    """Same-size images of a request are encoded in one tower call; tokens equal per-image encoding."""
    from perfkit.runtime.vision import build_vision_tower, get_vision_preset, synthetic_images

    cfg, model = model_for("tiny")
    tower = build_vision_tower(get_vision_preset("tiny"), cfg.hidden_size, "cpu", torch.float32, seed=3)
    rng = random.Random(7)
    sizes = [70, 70, 140]  # two images of one size (one batch), then another size (a second call)
    ids, types = [2], [0]
    items = []
    for i, soft in enumerate(sizes):
        ids += [rng.randint(3, 400), cfg.boi_token_id] + [cfg.image_token_id] * soft + [cfg.eoi_token_id]
        types += [0, 0] + [1] * soft + [0]
        pv, pp = synthetic_images(1, soft, seed=100 + i)
        items.append({"pixel_values": pv, "pixel_position_ids": pp})
    ids += [5, 6, 7]
    types += [0, 0, 0]
    eng = cpu_engine(model, cfg, max_num_tokens=96, mm_embed_cache=cache == "on")
    eng.set_vision_tower(tower)
    rid = eng.add_request(ids, mm_items=items, max_new_tokens=6, token_type_ids=types)
    out = eng.generate_all()[rid]
    with torch.no_grad():
        per_image = torch.cat([tower(it["pixel_values"], it["pixel_position_ids"]) for it in items])
    assert out == greedy_generate(model, ids, 6, mm_embeds=per_image, token_type_ids=types)
    if cache == "on":
        assert eng.stats.encoder_calls == 2  # [70, 70] batched, [140] alone
    # the per-call image cap splits the same-size run: [70], [70], [140], same tokens
    capped = cpu_engine(model, cfg, max_num_tokens=96, mm_embed_cache=cache == "on", max_images_per_encode=1)
    capped.set_vision_tower(tower)
    rid = capped.add_request(ids, mm_items=items, max_new_tokens=6, token_type_ids=types)
    assert capped.generate_all()[rid] == out
    if cache == "on":
        assert capped.stats.encoder_calls == 3
