"""Synthetic request generation: determinism, length distributions, datasets, shared prefix, multimodal layout."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from perfkit.config import LengthDist, RunConfig, WorkloadConfig
from perfkit.errors import PerfkitError
from perfkit.workloads.requests import (
    GAP_TOKENS,
    LEAD_IN_TOKENS,
    VIDEO_TIMESTAMP_TOKENS,
    Request,
    TokenSpace,
    generate_requests,
    iter_requests,
    load_dataset,
    requests_digest,
    sample_lengths,
    summarize,
    workload_hash,
)

# the tiny presets' ids: pad 0, eos 1, bos 2, boi 500, eoi 501, image 502, video 503, audio 504, boa 505, eoa 506
TINY = TokenSpace(
    vocab_size=512,
    image_token_id=502,
    video_token_id=503,
    boi_token_id=500,
    eoi_token_id=501,
    bos_token_id=2,
    reserved_ids=(0, 1, 504, 505, 506),
)


def wl(**kw) -> WorkloadConfig:
    kw.setdefault("osl", 16)
    return WorkloadConfig.model_validate(kw)


def runs(types: np.ndarray) -> list[tuple[int, int, int]]:
    """(type, start, length) of each maximal run of equal non-zero token types."""
    out = []
    i = 0
    while i < len(types):
        j = i + 1
        while j < len(types) and types[j] == types[i]:
            j += 1
        if types[i]:
            out.append((int(types[i]), i, j - i))
        i = j
    return out


# ------------------------------------------------------------------------------------------------- token space


def test_text_ids_avoid_specials_and_cover_the_rest():
    ids = TINY.text_ids(np.random.default_rng(0), 200_000)
    assert ids.dtype == np.int32
    excluded = {0, 1, 2, 500, 501, 502, 503, 504, 505, 506}
    seen = set(np.unique(ids).tolist())
    assert seen == set(range(512)) - excluded  # uniform over every allowed id, none excluded
    counts = np.bincount(ids, minlength=512)[sorted(seen)]
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()


def test_token_space_from_model_config_duck_typed():
    cfg = SimpleNamespace(
        vocab_size=512, pad_token_id=0, eos_token_id=(1, 7), bos_token_id=2, image_token_id=502, video_token_id=503,
        boi_token_id=500, eoi_token_id=501, audio_token_id=504, boa_token_id=505, eoa_token_id=506,
    )  # fmt: skip
    ts = TokenSpace.from_model_config(cfg)
    assert ts.bos_token_id == 2 and set(ts.reserved_ids) == {0, 1, 7, 504, 505, 506}
    ids = ts.text_ids(np.random.default_rng(1), 50_000)
    assert not np.isin(ids, [0, 1, 2, 7, 500, 501, 502, 503, 504, 505, 506]).any()


def test_token_space_rejects_ids_outside_vocab():
    with pytest.raises(PerfkitError, match="outside the vocab"):
        TokenSpace(vocab_size=100, image_token_id=502, video_token_id=3, boi_token_id=4, eoi_token_id=5)
    TokenSpace.gemma4()  # the real ids fit the real vocab


# ----------------------------------------------------------------------------------------------- determinism


MM = dict(isl=LengthDist(dist="uniform", mean=40, range_ratio=0.5), osl=LengthDist(dist="normal", mean=20, std=5))


def test_same_seed_byte_identical_different_seed_different():
    w = wl(**MM, shared_prefix_len=8, images={"count": 2, "tokens_per_image": 70}, video={"frames": 2})
    a = generate_requests(w, 20, TINY, seed=3)
    b = generate_requests(w, 20, TINY, seed=3)
    assert requests_digest(a) == requests_digest(b)
    assert [r.digest() for r in a] == [r.digest() for r in b]
    assert requests_digest(generate_requests(w, 20, TINY, seed=4)) != requests_digest(a)
    w2 = w.model_copy(update={"seed": 1})
    assert requests_digest(generate_requests(w2, 20, TINY, seed=3)) != requests_digest(a)


def test_requests_do_not_depend_on_n_and_stream_matches():
    w = wl(**MM, images={"count": 1, "tokens_per_image": 70})
    ten = generate_requests(w, 10, TINY, seed=5)
    five = generate_requests(w, 5, TINY, seed=5)
    assert requests_digest(ten[:5]) == requests_digest(five)
    it = iter_requests(w, TINY, seed=5)
    assert requests_digest(next(it) for _ in range(10)) == requests_digest(ten)
    assert requests_digest(iter_requests_slice(w, 7, 3)) == requests_digest(ten[7:10])


def iter_requests_slice(w, start, count):
    it = iter_requests(w, TINY, seed=5, start=start)
    return [next(it) for _ in range(count)]


def test_request_is_immutable():
    r = generate_requests(wl(isl=8), 1, TINY)[0]
    with pytest.raises(ValueError):
        r.prompt_token_ids[0] = 5
    assert r.prompt_token_ids.dtype == np.int32 and r.token_type_ids.dtype == np.int8


def test_workload_hash_stable_and_sensitive(tmp_path):
    w = wl(isl=32)
    h = workload_hash(w, 100, 0)
    assert h == workload_hash(wl(isl=32), 100, 0) and len(h) == 16
    assert h != workload_hash(w, 101, 0)
    assert h != workload_hash(w, 100, 1)
    assert h != workload_hash(wl(isl=33), 100, 0)
    assert h != workload_hash(w, 100, 0, token_space=TINY)
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"input_len": 4, "output_len": 2}\n')
    wd = wl(dataset=str(ds))
    h1 = workload_hash(wd, 10, 0)
    ds.write_text('{"input_len": 5, "output_len": 2}\n')
    assert workload_hash(wd, 10, 0) != h1  # an edited file changes the hash


# --------------------------------------------------------------------------------------------------- lengths


@pytest.mark.parametrize(
    ("dist", "mean", "std"),
    [
        (LengthDist(dist="uniform", mean=1000, range_ratio=0.5), 1000, 1000 * 0.5 / np.sqrt(3)),
        (LengthDist(dist="normal", mean=1000, std=100), 1000, 100),
    ],
)
def test_length_moments(dist, mean, std):
    x = sample_lengths(dist, np.random.default_rng(0), 50_000)
    assert x.dtype == np.int64
    assert abs(x.mean() - mean) < 0.01 * mean
    assert abs(x.std() - std) < 0.03 * std


def test_lognormal_median_is_mean():
    x = sample_lengths(LengthDist(dist="lognormal", mean=500, sigma=0.6), np.random.default_rng(1), 50_000)
    assert abs(np.median(x) - 500) < 0.02 * 500
    assert abs(np.log(x).std() - 0.6) < 0.02


def test_uniform_bounds_inclusive():
    x = sample_lengths(LengthDist(dist="uniform", mean=10, range_ratio=0.2), np.random.default_rng(2), 10_000)
    assert set(np.unique(x).tolist()) == {8, 9, 10, 11, 12}
    assert (sample_lengths(LengthDist(mean=77), np.random.default_rng(0), 5) == 77).all()


def test_clipping_and_minimum_one():
    d = LengthDist(dist="normal", mean=100, std=200, min=50, max=150)
    x = sample_lengths(d, np.random.default_rng(3), 20_000)
    assert x.min() == 50 and x.max() == 150
    assert (x == 50).mean() > 0.3 and (x == 150).mean() > 0.3  # heavy mass at both clips
    y = sample_lengths(LengthDist(dist="normal", mean=2, std=50), np.random.default_rng(4), 10_000)
    assert y.min() == 1
    z = sample_lengths(LengthDist(mean=300, max=200), np.random.default_rng(0), 3)
    assert (z == 200).all()  # fixed is clipped too


def test_generated_lengths_follow_config():
    w = wl(isl=LengthDist(dist="normal", mean=200, std=20), osl=LengthDist(dist="uniform", mean=50, range_ratio=1.0))
    rs = generate_requests(w, 3000, TINY, seed=0)
    isl = np.array([r.input_len for r in rs])
    osl = np.array([r.output_len for r in rs])
    assert abs(isl.mean() - 200) < 2 and abs(isl.std() - 20) < 1.5
    assert abs(osl.mean() - 50) < 2 and osl.min() == 1 and osl.max() == 100
    assert all(r.num_text_tokens == r.input_len and r.num_vision_tokens == 0 for r in rs)


# -------------------------------------------------------------------------------------------------- datasets


def write(tmp_path, lines: list[str]):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_dataset_good_lines(tmp_path):
    p = write(
        tmp_path,
        [
            json.dumps({"input_ids": [5, 6, 7, 8], "output_len": 3}),
            "",
            json.dumps({"input_len": 12, "output_tokens": 9, "task_id": 4}),
            json.dumps({"input_len": 6}),
        ],
    )
    w = wl(dataset=str(p), osl=LengthDist(mean=11))
    rs = generate_requests(w, 5, TINY, seed=0)
    assert rs[0].prompt_token_ids.tolist() == [5, 6, 7, 8] and rs[0].output_len == 3  # verbatim, no bos added
    assert rs[1].input_len == 12 and rs[1].output_len == 9 and rs[1].prompt_token_ids[0] == 2
    assert rs[2].input_len == 6 and rs[2].output_len == 11  # output_len missing -> drawn from osl
    assert rs[3].prompt_token_ids.tolist() == [5, 6, 7, 8]  # cycles past the end
    # relative path resolved against base_dir
    rel = wl(dataset="data.jsonl")
    assert requests_digest(generate_requests(rel, 5, TINY, base_dir=tmp_path)) == requests_digest(
        generate_requests(wl(dataset=str(p)), 5, TINY)
    )


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ('{"input_len": 4, "output_len": 2', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"output_len": 2}', "exactly one of input_ids or input_len"),
        ('{"input_len": 3, "input_ids": [1], "output_len": 2}', "exactly one of input_ids or input_len"),
        ('{"input_len": 0, "output_len": 2}', "input_len must be an integer >= 1"),
        ('{"input_len": 2.5, "output_len": 2}', "input_len must be an integer >= 1"),
        ('{"input_len": 4, "output_len": -1}', "output_len must be an integer >= 1"),
        ('{"input_ids": [], "output_len": 2}', "non-empty list of integers"),
        ('{"input_ids": [1, "a"], "output_len": 2}', "non-empty list of integers"),
        ('{"input_ids": [1, 9999], "output_len": 2}', "9999, outside the vocab"),
        ('{"prompt": "hi", "output_len": 2}', "need a tokenizer"),
        ('{"input_len": 4, "output_len": 2, "foo": 1}', "unknown key"),
    ],
)
def test_dataset_malformed_line_names_file_and_line(tmp_path, line, msg):
    p = write(tmp_path, ['{"input_len": 4, "output_len": 2}', line])
    with pytest.raises(PerfkitError, match=msg) as err:
        load_dataset(p, TINY)
    assert f"{p}:2:" in str(err.value)


def test_dataset_missing_empty_and_isl_conflict(tmp_path):
    with pytest.raises(PerfkitError, match="not found"):
        generate_requests(wl(dataset=str(tmp_path / "nope.jsonl")), 1, TINY)
    empty = write(tmp_path, [""])
    with pytest.raises(PerfkitError, match="no requests"):
        load_dataset(empty)
    with pytest.raises(ValueError, match="not both"):  # the config refuses isl + dataset already
        wl(isl=4, dataset=str(empty))


# --------------------------------------------------------------------------------------------- shared prefix


def test_shared_prefix():
    w = wl(isl=LengthDist(dist="uniform", mean=30, range_ratio=0.5), shared_prefix_len=24)
    rs = generate_requests(w, 50, TINY, seed=9)
    prefix = rs[0].prompt_token_ids[:24]
    assert prefix[0] == TINY.bos_token_id
    for r in rs:
        assert r.shared_prefix_len == 24
        assert np.array_equal(r.prompt_token_ids[:24], prefix)
        assert (r.token_type_ids[:24] == 0).all()
        assert r.prompt_token_ids[24:].size >= 15  # the per-request part is the ISL
        assert TINY.bos_token_id not in r.prompt_token_ids[1:]
    tails = {r.prompt_token_ids[24:].tobytes() for r in rs}
    assert len(tails) == 50
    other = generate_requests(w, 1, TINY, seed=10)[0]
    assert not np.array_equal(other.prompt_token_ids[:24], prefix)  # the prefix is seeded
    no_prefix = generate_requests(wl(isl=8), 3, TINY)
    assert all(r.prompt_token_ids[0] == 2 and r.shared_prefix_len == 0 for r in no_prefix)


# ----------------------------------------------------------------------------------------------- multimodal


def test_image_layout():
    w = wl(isl=20, shared_prefix_len=5, images={"count": 3, "tokens_per_image": 70})
    rs = generate_requests(w, 4, TINY, seed=0)
    for r in rs:
        ids, types = r.prompt_token_ids, r.token_type_ids
        assert r.input_len == 5 + 20 + 3 * 72
        assert r.num_image_tokens == 210 and r.num_video_tokens == 0 and r.num_text_tokens == 25 + 6
        blobs = runs(types)
        assert [(k, n) for k, _, n in blobs] == [(1, 70)] * 3
        starts = [s for _, s, _ in blobs]
        assert [m.offsets[0] for m in r.mm_items] == starts
        assert all(m.kind == "image" and m.num_soft_tokens == 70 and m.num_frames == 1 for m in r.mm_items)
        for s in starts:
            assert ids[s - 1] == TINY.boi_token_id and types[s - 1] == 0
            assert ids[s + 70] == TINY.eoi_token_id and types[s + 70] == 0
            assert (ids[s : s + 70] == TINY.image_token_id).all()
        # lead-in after the prefix, then GAP_TOKENS between images, tail is the rest of the ISL
        assert starts[0] - 1 == 5 + LEAD_IN_TOKENS
        assert starts[1] - (starts[0] + 71) == GAP_TOKENS + 1  # gap + boi
        tail = r.input_len - (starts[2] + 71)
        assert tail == 20 - LEAD_IN_TOKENS - 2 * GAP_TOKENS
        # special ids appear only where the layout puts them
        text = ids[types == 0]
        assert (text == TINY.boi_token_id).sum() == 3 and (text == TINY.eoi_token_id).sum() == 3
        assert not np.isin(ids[types == 0], [TINY.image_token_id, TINY.video_token_id]).any()
        assert not np.isin(ids, list(TINY.reserved_ids)).any()


def test_video_layout():
    w = wl(isl=10, video={"frames": 4, "tokens_per_frame": 70})
    r = generate_requests(w, 1, TINY, seed=1)[0]
    ids, types = r.prompt_token_ids, r.token_type_ids
    frames = runs(types)
    assert [(k, n) for k, _, n in frames] == [(2, 70)] * 4
    (item,) = r.mm_items
    assert (
        item.kind == "video" and item.num_frames == 4 and item.num_soft_tokens == 70 and item.total_soft_tokens == 280
    )
    assert list(item.offsets) == [s for _, s, _ in frames]
    assert frames[0][1] == LEAD_IN_TOKENS + VIDEO_TIMESTAMP_TOKENS + 1  # lead-in, "mm:ss ", boi
    for (_, s, _), (_, nxt, _) in zip(frames, frames[1:], strict=False):
        assert ids[s - 1] == TINY.boi_token_id and ids[s + 70] == TINY.eoi_token_id
        assert nxt - (s + 71) == 1 + VIDEO_TIMESTAMP_TOKENS + 1  # separator, timestamp, boi
        between = ids[s + 71 : nxt - 1]
        assert not np.isin(between, [500, 501, 502, 503]).any()
    assert r.num_video_tokens == 280 and r.num_image_tokens == 0
    assert r.input_len == 10 + 4 * (70 + 2 + VIDEO_TIMESTAMP_TOKENS) + 3
    assert r.num_text_tokens == r.input_len - 280


def test_images_and_video_fit_config_bound():
    """The prompt never exceeds what RunConfig's max_model_len check assumes."""
    w = wl(isl=LengthDist(dist="uniform", mean=50, range_ratio=1.0), shared_prefix_len=3,
           images={"count": 2, "tokens_per_image": 140}, video={"frames": 5, "tokens_per_frame": 70})  # fmt: skip
    bound = 3 + 100 + 2 * (140 + 2) + 5 * (70 + 6)
    rs = generate_requests(w, 200, TINY, seed=0)
    assert max(r.input_len for r in rs) <= bound
    assert all(r.num_image_tokens == 280 and r.num_video_tokens == 350 for r in rs)
    assert all(r.num_text_tokens + r.num_vision_tokens == r.input_len for r in rs)
    # types: images before the video
    kinds = [k for k, _, _ in runs(rs[0].token_type_ids)]
    assert kinds == [1, 1, 2, 2, 2, 2, 2]
    RunConfig.model_validate(
        {"name": "x", "runtime": {"max_model_len": bound + 16},
         "scenarios": [{"name": "s", "num_requests": 1, "workload": w.model_dump()}]}
    )  # fmt: skip


def test_mm_seeds_distinct_across_items_and_requests():
    w = wl(isl=8, images={"count": 3, "tokens_per_image": 70}, video={"frames": 2})
    rs = generate_requests(w, 100, TINY, seed=0)
    seeds = [m.seed for r in rs for m in r.mm_items]
    assert len(seeds) == 400 and len(set(seeds)) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    other = [m.seed for r in generate_requests(w, 100, TINY, seed=1) for m in r.mm_items]
    assert set(other).isdisjoint(seeds)  # another seed, other pixels


def test_tiny_isl_with_images():
    """An ISL smaller than the lead-in still yields a valid layout: bos first, images adjacent."""
    r = generate_requests(wl(isl=1, images={"count": 2, "tokens_per_image": 70}), 1, TINY)[0]
    assert r.prompt_token_ids[0] == 2 and r.prompt_token_ids[1] == TINY.boi_token_id
    assert r.input_len == 1 + 2 * 72 and len(runs(r.token_type_ids)) == 2


def test_summary_counts():
    w = wl(isl=10, osl=4, images={"count": 1, "tokens_per_image": 70})
    s = summarize(generate_requests(w, 3, TINY))
    assert s == {
        "num_requests": 3, "input_tokens": 3 * 82, "text_tokens": 3 * 12, "image_tokens": 210,
        "video_tokens": 0, "output_tokens": 12, "mm_items": 3,
    }  # fmt: skip


def test_request_validates_shapes():
    with pytest.raises(ValueError):
        Request(0, np.zeros(3, np.int32), np.zeros(2, np.int8), 1)
    with pytest.raises(ValueError):
        Request(0, np.zeros(3, np.int32), np.zeros(3, np.int8), 0)
