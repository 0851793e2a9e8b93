"""`perfkit kernels attention`: case shapes and bounds by hand arithmetic, input errors, and the GPU sweep itself."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from perfkit.cli import app
from perfkit.errors import PerfkitError
from perfkit.runners.attention_sweep import (
    attention_cases,
    best_impls,
    decode_bytes,
    model_pools,
    parse_triton_tiles,
    prefill_flops,
)


def test_31b_pool_shapes_and_bounds_by_hand():
    pools = model_pools("31b")
    sl, full = pools["sliding"], pools["full"]
    assert (sl.num_heads, sl.num_kv_heads, sl.head_dim, sl.window) == (32, 16, 256, 1024)
    assert (full.num_kv_heads, full.head_dim, full.window) == (4, 512, None)
    # batch 1, 4096 context: the sliding pool reads only its 1024-key window
    assert decode_bytes(sl, 1, 4096, 2) == 1024 * 16 * 256 * 2 * 2 + 2 * 32 * 256 * 2
    assert decode_bytes(full, 2, 4096, 1) == 2 * 4096 * 4 * 512 * 2 * 1 + 2 * 2 * 32 * 512 * 2
    # causal: query i sees i + 1 keys; with a window W it sees min(i + 1, W)
    assert prefill_flops(full, 4) == 4 * 32 * 512 * (1 + 2 + 3 + 4)
    assert prefill_flops(sl, 1026) == 4 * 32 * 256 * (1024 * 1025 // 2 + 2 * 1024)


def test_cases_dedupe_windowed_lengths_and_fill_bounds():
    rows = attention_cases("31b", ["sliding", "full"], [1, 16], [1024, 4096], [8192], ["cuda_cores", "tc_fa2"], ["fa2"])
    decode = [r for r in rows if r["kernel"] == "attention_decode"]
    # sliding: 4096 is capped to the 1024 window, so one length; full: two
    assert len(decode) == 2 * 2 * (1 + 2)
    sl = [r for r in decode if r["shape"]["pool"] == "sliding"]
    assert {r["shape"]["kv_len"] for r in sl} == {1024}
    r = next(r for r in decode if r["shape"]["pool"] == "full" and r["shape"]["batch"] == 16)
    assert r["bound_ms"] == pytest.approx(r["bytes"] / 4.3e12 * 1e3)
    pre = [r for r in rows if r["kernel"] == "attention_prefill"]
    assert len(pre) == 2 and all(r["bound_ms"] == pytest.approx(r["flops"] / 790e12 * 1e3) for r in pre)
    assert all(r["median_ms"] is None and r["status"] == "ok" for r in rows)


def test_best_impls_picks_the_fastest_ok_row():
    rows = attention_cases("26b-a4b", ["sliding"], [1], [1024], [], ["cuda_cores", "tc_fa2", "tc_fa3"], [])
    for r, ms in zip(rows, [0.02, 0.008, 0.001], strict=True):
        r["median_ms"] = ms
    rows[2]["status"] = "error"
    assert best_impls(rows) == {"decode sliding b1 kv1024": "tc_fa2"}


def test_triton_tiles_give_one_row_each_and_name_the_winner():
    tiles = parse_triton_tiles("32x4x2, 64x8x1")
    assert tiles == [{"block_n": 32, "num_warps": 4, "programs_per_sm": 2},
                     {"block_n": 64, "num_warps": 8, "programs_per_sm": 1}]  # fmt: skip
    rows = attention_cases("26b-a4b", ["full"], [1], [1024], [], ["tc_fa2", "triton"], [], triton_tiles=tiles)
    assert [(r["impl"], r.get("tile")) for r in rows] == [("tc_fa2", None), ("triton", tiles[0]), ("triton", tiles[1])]
    for r, ms in zip(rows, [0.015, 0.019, 0.014], strict=True):
        r["median_ms"] = ms
    assert best_impls(rows) == {"decode full b1 kv1024": "triton 64x8x1"}
    plain = attention_cases("26b-a4b", ["full"], [1], [1024], [], ["triton"], [])
    assert len(plain) == 1 and "tile" not in plain[0]  # no tiles: the kernel's defaults
    with pytest.raises(PerfkitError, match="keys are block_n, num_warps, programs_per_sm"):
        attention_cases("26b-a4b", ["full"], [1], [1024], [], ["triton"], [], triton_tiles=[{"warps": 4}])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--decode-impl", "tensor"], "decode impl(s) tensor: allowed values are cuda_cores, tc_fa2, tc_fa3"),
        (["--prefill-impl", "fa4"], "prefill impl(s) fa4"),
        (["--preset", "nope"], "unknown model preset 'nope'"),
        (["--pools", "local"], "--pools local: 31b has pools sliding, full"),
        (["--kv-dtype", "fp4"], "--kv-dtype 'fp4'"),
        (["--batch-sizes", "a"], "--batch-sizes 'a': expected comma-separated integers"),
        (["--repeats", "0"], "--repeats and --page-size must be >= 1"),
        (["--triton-tiles", "32x4"], "--triton-tiles '32x4': expected BLOCK_NxWARPSxPROGRAMS_PER_SM items"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    res = CliRunner().invoke(app, ["kernels", "attention", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only message")
def test_cpu_says_it_needs_a_gpu():
    res = CliRunner().invoke(app, ["kernels", "attention"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


def test_unknown_pool_raises():
    with pytest.raises(PerfkitError, match="pools"):
        attention_cases("31b", ["chunked"], [1], [16], [], ["cuda_cores"], [])


@pytest.mark.gpu
def test_gpu_sweep_every_impl_agrees(tmp_path):
    """A small sweep on the GPU: every decode impl and FA2 prefill run, time, and agree with each other."""
    pytest.importorskip("flashinfer")
    res = CliRunner().invoke(
        app,
        ["kernels", "attention", "--preset", "26b-a4b", "--batch-sizes", "1,4", "--kv-lens", "512",
         "--prefill-q-lens", "1024", "--prefill-impl", "fa2", "--repeats", "3", "--out", str(tmp_path)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    (path,) = tmp_path.glob("*/result.json")
    rows = json.loads(path.read_text())["kernels"]
    assert rows and all(r["status"] == "ok" for r in rows if r["impl"] != "tc_fa3"), rows
    for r in rows:
        if r["status"] == "ok":
            assert r["median_ms"] > 0 and r["max_abs_diff"] < 2e-2, r
