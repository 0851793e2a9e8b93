"""Gemma4 packed sliding-layer mask: Triton (B) and dense (A) paths against a rule-based numpy reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported.
"""

import numpy as np
import pytest
import torch

from perfkit.kernels.gemma_mask import (
    build_gemma_attention_mask,
    gemma_mask,
    gemma_mask_peak_bytes,
    gemma_mask_ref,
    gemma_mask_traffic,
)

MiB = 2**20
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------------------------
# Independent reference, written straight from the rule (gemma4.md §4.4 with absolute positions):
#   allow(a, b) = (a - b < W) and (b <= a or same_blob(a, b)); blob = maximal run of one vision type (1 or 2)
#   among the new tokens; prefix keys are never in a blob; W None = no window.
# --------------------------------------------------------------------------------------------------------------


def rule_mask(types: np.ndarray, q_lens, p_lens, window) -> np.ndarray:
    flats, start = [], 0
    for q, p in zip(q_lens, p_lens, strict=True):
        t = types[start : start + q]
        start += q
        if q == 0:
            continue
        run_id = np.cumsum(np.r_[True, t[1:] != t[:-1]])  # same id for a maximal run of one type value
        blob = np.where((t == 1) | (t == 2), run_id, -1)
        key_blob = np.concatenate([np.full(p, -1), blob])  # cached prefix: no blob
        a = p + np.arange(q)[:, None]  # absolute query positions
        b = np.arange(p + q)[None, :]  # absolute key positions
        same_blob = (blob[:, None] >= 0) & (blob[:, None] == key_blob[None, :])
        in_window = np.ones((q, p + q), bool) if window is None else (a - b < window)
        flats.append((in_window & ((b <= a) | same_blob)).ravel())
    return np.concatenate(flats) if flats else np.zeros(0, bool)


def random_types(rng: np.random.Generator, n: int, max_run: int = 12) -> np.ndarray:
    """Runs of text/image/video/audio, including vision runs of different types back to back."""
    out: list[int] = []
    while len(out) < n:
        kind = int(rng.choice([0, 1, 2, 3], p=[0.35, 0.3, 0.2, 0.15]))
        out += [kind] * int(rng.integers(1, max_run + 1))
    return np.array(out[:n], dtype=np.int64)


def check(types, q_lens, p_lens, window, **blocks) -> None:
    expected = rule_mask(np.asarray(types), q_lens, p_lens, window)
    t = torch.as_tensor(np.asarray(types, dtype=np.int64), device=DEVICE)
    got_b = gemma_mask(t, q_lens, p_lens, window, **blocks)
    got_a = gemma_mask_ref(t, q_lens, p_lens, window)
    assert got_b.dtype == torch.bool and got_a.dtype == torch.bool
    assert got_b.numel() == expected.size == gemma_mask_traffic(q_lens, p_lens)["output_bytes"]
    np.testing.assert_array_equal(got_a.cpu().numpy(), expected)
    np.testing.assert_array_equal(got_b.cpu().numpy(), expected)


SMALL_TILES = {"block_m": 4, "block_n": 16, "block_t": 8}  # many tiles, shifts, edges, carries across blocks


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_rule(seed):
    rng = np.random.default_rng(seed)
    n_req = int(rng.integers(1, 4))
    q_lens = [int(rng.choice([1, int(rng.integers(2, 48))])) for _ in range(n_req)]
    p_lens = [int(rng.choice([0, int(rng.integers(1, 40))])) for _ in range(n_req)]
    types = random_types(rng, sum(q_lens))
    for window in (None, 1, 5, 16, 1000):
        check(types, q_lens, p_lens, window)
    check(types, q_lens, p_lens, 7, **SMALL_TILES)


def test_blob_longer_than_window_and_type_change():
    # text, 20 image tokens (> W), 6 video tokens directly after (a new blob), audio, image.
    types = [0, 0] + [1] * 20 + [2] * 6 + [3] * 4 + [1] * 3 + [0]
    q = len(types)
    for window in (1, 4, 9, 30):
        check(types, [q], [0], window)
        check(types, [q], [11], window, **SMALL_TILES)


def test_audio_and_text_are_causal_vision_is_bidirectional():
    types = torch.tensor([3, 3, 3, 0, 0, 1, 1, 1], device=DEVICE)
    m = build_gemma_attention_mask(types, [8], [0], None).cpu().view(8, 8)
    assert not m[0, 1] and not m[3, 4]  # audio, text: no look-ahead
    assert m[5, 7] and m[6, 5]  # image blob: both directions
    assert not m[4, 5]  # text before the blob does not see it
    assert torch.equal(m, build_gemma_attention_mask(types, [8], [0], None, impl="dense").cpu().view(8, 8))


def test_prefix_columns_follow_the_window():
    types = torch.tensor([0, 1, 1], device=DEVICE)
    m = gemma_mask(types, [3], [5], 4).cpu().view(3, 8)
    # query a = 5 + i sees keys b with a - b < 4 (and b <= a, or its blob 6..7)
    assert m[0].tolist() == [False, False, True, True, True, True, False, False]
    assert m[1].tolist() == [False, False, False, True, True, True, True, True]
    assert m[2].tolist() == [False, False, False, False, True, True, True, True]


def test_edge_cases():
    # Q = 1 rows, empty requests in between, a single vision token, all empty.
    check([1], [1], [0], None)
    check([2, 0, 1], [1, 0, 2, 0], [7, 3, 0, 9], 2)
    check([1] * 5, [5], [3], 1, **SMALL_TILES)
    empty = gemma_mask(torch.zeros(0, dtype=torch.int64, device=DEVICE), [0, 0], [4, 0], 8)
    assert empty.numel() == 0
    assert gemma_mask_ref(torch.zeros(0, dtype=torch.int64, device=DEVICE), [], [], None).numel() == 0


def test_many_requests_exercise_request_search():
    rng = np.random.default_rng(7)
    q_lens = [int(x) for x in rng.integers(0, 9, size=13)]
    p_lens = [int(x) for x in rng.integers(0, 12, size=13)]
    check(random_types(rng, sum(q_lens), max_run=4), q_lens, p_lens, 6, **SMALL_TILES)


def test_int32_type_ids_and_tensor_lengths():
    rng = np.random.default_rng(3)
    types = torch.as_tensor(random_types(rng, 40), dtype=torch.int32, device=DEVICE)
    q, p = torch.tensor([25, 15]), torch.tensor([0, 30])
    got = gemma_mask(types, q, p, 10)
    expected = rule_mask(types.cpu().numpy(), [25, 15], [0, 30], 10)
    np.testing.assert_array_equal(got.cpu().numpy(), expected)


def test_bad_inputs():
    t = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="sum\\(seq_lens\\)"):
        gemma_mask(t, [3], [0], None)
    with pytest.raises(ValueError, match="requests"):
        gemma_mask_ref(t, [4], [0, 1], None)
    with pytest.raises(ValueError, match="impl"):
        build_gemma_attention_mask(t, [4], [0], None, impl="sparse")
    with pytest.raises(ValueError, match="sliding_window"):
        gemma_mask_ref(t, [4], [0], 0)


def test_traffic_and_peak_formulas_match_the_spec_table():
    # gemma4.md §5.3 (bool bytes, one request): dense peak 3Q^2 + 2QP, output Q(P+Q).
    table = {(8192, 0): 192, (16384, 0): 768, (32768, 0): 3072, (8192, 8192): 320, (16384, 16384): 1280}
    for (q, p), dense_mib in table.items():
        assert gemma_mask_peak_bytes([q], [p], 1024, "dense") == dense_mib * MiB
        tr = gemma_mask_traffic([q], [p])
        assert tr["output_bytes"] == q * (p + q)
        assert tr["bytes_written"] == q * (p + q) + 4 * q
        assert tr["bytes_read"] == 8 * q + 4 * q + 8 * 8
        assert tr["total_bytes"] == tr["bytes_written"] + tr["bytes_read"]
        assert gemma_mask_peak_bytes([q], [p], 1024, "triton") == q * (p + q) + 4 * q + 64
    assert gemma_mask_traffic([8192], [0], type_id_bytes=4)["bytes_read"] == 8 * 8192 + 64
    # Batch: request 0 finished (Q0 L0 alive) while request 1 builds, then the final cat doubles everything.
    q0, p0, q1, p1 = 100, 50, 300, 0
    total = q0 * (p0 + q0) + q1 * (p1 + q1)
    expected = max(3 * q0 * q0 + 2 * q0 * p0, q0 * (p0 + q0) + 3 * q1 * q1, 2 * total)
    assert gemma_mask_peak_bytes([q0, q1], [p0, p1], None, "dense") == expected


# --------------------------------------------------------------------------------------------------------------
# GPU: realistic shapes on the device (H200)
# --------------------------------------------------------------------------------------------------------------


def image_heavy_types(q: int, image_tokens: int = 280, text_between: int = 12) -> np.ndarray:
    unit = [0] + [1] * image_tokens + [0] + [0] * text_between  # boi, image, eoi, text
    head = [0] * 37
    return np.array((head + unit * (q // len(unit) + 1))[:q], dtype=np.int64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q,p,window", [(8192, 8192, 1024), (8192, 0, 1024), (4099, 3001, 1024), (2048, 0, 200)])
def test_gpu_single_request_matches_dense_and_rule(q, p, window):
    types = image_heavy_types(q)
    types[q // 3 : q // 3 + 1500] = 2  # a video run longer than some windows
    t = torch.as_tensor(types, device="cuda")
    b = build_gemma_attention_mask(t, [q], [p], window, impl="triton")
    a = build_gemma_attention_mask(t, [q], [p], window, impl="dense")
    assert torch.equal(a, b)
    np.testing.assert_array_equal(b.cpu().numpy(), rule_mask(types, [q], [p], window))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_random_batches_and_tile_configs():
    rng = np.random.default_rng(11)
    for _ in range(4):
        n_req = int(rng.integers(1, 9))
        q_lens = [int(x) for x in rng.integers(0, 2500, size=n_req)]
        p_lens = [int(rng.choice([0, int(rng.integers(1, 5000))])) for _ in range(n_req)]
        types = random_types(rng, sum(q_lens), max_run=600)
        expected = rule_mask(types, q_lens, p_lens, 512)
        t = torch.as_tensor(types, device="cuda")
        for blocks in ({}, {"block_m": 8, "block_n": 1024}, {"block_m": 32, "block_n": 256, "num_warps": 8}):
            np.testing.assert_array_equal(gemma_mask(t, q_lens, p_lens, 512, **blocks).cpu().numpy(), expected)
        np.testing.assert_array_equal(gemma_mask_ref(t, q_lens, p_lens, 512).cpu().numpy(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["triton", "dense"])
def test_gpu_peak_memory_matches_formula(impl):
    q, p = 8192, 8192
    t = torch.as_tensor(image_heavy_types(q), device="cuda")
    build_gemma_attention_mask(t, [q], [p], 1024, impl=impl)  # compile / warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = build_gemma_attention_mask(t, [q], [p], 1024, impl=impl)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    predicted = gemma_mask_peak_bytes([q], [p], 1024, impl)
    assert out.numel() == q * (p + q)
    if impl == "triton":
        assert q * (p + q) <= peak <= predicted + 2048
    else:  # quadratic terms exact, plus O(Q) int64 temporaries
        assert predicted <= peak <= predicted + 64 * q + 2 * MiB
