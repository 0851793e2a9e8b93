"""Overlapped engine steps (toggle overlap): step N+1 is scheduled, prepared and launched before step N's sampled
ids are waited for; N+1's decodes read their input ids on the device. Same tokens as the synchronous engine and
the dense greedy reference, EOS requests never deferred, and the call order that makes the overlap real."""

import random

import pytest

from perfkit.runtime.generate import greedy_generate
from tests.test_engine_cpu import cpu_engine, mm_prompt, model_for, random_prompts, run_staggered


@pytest.mark.parametrize("name", ["tiny", "tiny-e2b", "tiny-moe"])
@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_on_and_off_match_dense_greedy_with_preemption(name, overlap):
    cfg, model = model_for(name)
    prompts = random_prompts(8, seed=21, lo=5, hi=45)
    max_new = [random.Random(i).randint(1, 20) for i in range(len(prompts))]
    eng = cpu_engine(model, cfg, num_kv_pages=40, max_num_tokens=16, overlap=overlap)  # small pool: preemption
    got = run_staggered(eng, prompts, max_new, [0, 0, 0, 1, 1, 4, 6, 6])
    for i, p in enumerate(prompts):
        assert got[i] == greedy_generate(model, p, max_new[i]), f"request {i}"
    assert eng.stats.preemptions > 0
    assert not eng.has_unfinished() and eng._pending is None
    eng.bm.check_no_leaks()


def test_overlap_multimodal_prefill_beside_deferred_decodes():
    """A vision prefill chunk in the same step as decodes whose ids are still on the device (the soft-token
    merge then resolves those ids on the host)."""
    import torch

    cfg, model = model_for("tiny")
    rng = random.Random(8)
    g = torch.Generator().manual_seed(1)
    text = random_prompts(2, seed=2)
    eng = cpu_engine(model, cfg, max_num_tokens=12)
    text_ids = [eng.add_request(p, max_new_tokens=16) for p in text]
    out: dict[int, list[int]] = {}

    def step() -> None:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)

    for _ in range(3):
        step()  # the text requests are decoding with a pending step now
    assert eng._pending is not None
    ids, types = mm_prompt(cfg, rng, 2, 7)
    items = [torch.randn(7, cfg.hidden_size, generator=g) * 0.5 for _ in range(2)]
    rid = eng.add_request(ids, mm_items=items, max_new_tokens=6, token_type_ids=types)
    while eng.has_unfinished():
        step()
    assert out[rid] == greedy_generate(model, ids, 6, mm_embeds=torch.cat(items), token_type_ids=types)
    for r, p in zip(text_ids, text, strict=True):
        assert out[r] == greedy_generate(model, p, 16)
    eng.bm.check_no_leaks()


def test_eos_requests_stop_exactly_and_are_never_deferred():
    cfg, model = model_for("tiny")
    p_eos, p_fixed = random_prompts(2, seed=31, lo=8, hi=20)
    ref = greedy_generate(model, p_eos, 12)
    eos = ref[4]
    stop = ref.index(eos) + 1  # the first occurrence ends the request
    eng = cpu_engine(model, cfg)
    r_eos = eng.add_request(p_eos, max_new_tokens=12, ignore_eos=False)
    eng.request(r_eos).eos_token_ids = (eos,)
    r_fixed = eng.add_request(p_fixed, max_new_tokens=12)
    out: dict[int, list[int]] = {}
    deferred_while_eos_ran = []
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if r_eos in {r.request_id for r in eng.scheduler.running} or len(out.get(r_eos, [])) < stop:
            deferred_while_eos_ran.append(eng._pending is not None)
    assert out[r_eos] == ref[:stop]
    assert out[r_fixed] == greedy_generate(model, p_fixed, 12)
    assert not any(deferred_while_eos_ran[: stop - 1])  # a step sampling the EOS-able request waits for its ids


@pytest.mark.parametrize("overlap", [True, False])
def test_call_order_waits_for_step_n_after_launching_step_n_plus_1(overlap):
    cfg, model = model_for("tiny")
    eng = cpu_engine(model, cfg, overlap=overlap)
    log: list[str] = []
    forward, wait = eng.runner.forward, eng._tokens.wait

    def logged_forward(inp):
        log.append("forward")
        return forward(inp)

    def logged_wait(ticket):
        log.append("wait")
        return wait(ticket)

    eng.runner.forward, eng._tokens.wait = logged_forward, logged_wait
    eng.add_request(random_prompts(1, seed=4)[0], max_new_tokens=5)
    first = eng.step()
    assert first == [] if overlap else len(first) == 1  # overlap: the prefill's token arrives one step later
    while eng.has_unfinished():
        eng.step()
    if overlap:  # 5 steps; each wait comes after the next step's forward, the last one after the final step
        assert log == ["forward", "forward", "wait", "forward", "wait", "forward", "wait", "forward", "wait", "wait"]
    else:
        assert log == ["forward", "wait"] * 5


def test_overlap_toggle_on_a_live_engine():
    cfg, model = model_for("tiny")
    prompts = random_prompts(4, seed=12, hi=25)
    eng = cpu_engine(model, cfg)
    rids = [eng.add_request(p, max_new_tokens=10) for p in prompts]
    out: dict[int, list[int]] = {}
    k = 0
    while eng.has_unfinished():
        eng.set_toggle("overlap", "off" if k % 3 == 1 else "on")
        k += 1
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.toggles()["overlap"] == "on"
    for r, p in zip(rids, prompts, strict=True):
        assert out[r] == greedy_generate(model, p, 10)
