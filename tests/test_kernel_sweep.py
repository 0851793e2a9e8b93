"""Kernel sweep runner: rows, statuses, OOM handling; on CPU the Triton path runs under TRITON_INTERPRET=1."""

import pytest
import torch
from isolation import in_fresh_process

from perfkit.kernels import gemma_mask as gm
from perfkit.runners.kernel_sweep import image_heavy_token_types, run_mask_sweep


def test_image_heavy_layout():
    t = image_heavy_token_types(1000, image_tokens=280, text_between=16, head_text=64)
    assert t.shape == (1000,) and t.dtype == torch.int64
    assert t[:64].eq(0).all() and t[64] == 0 and t[65:345].eq(1).all() and t[345] == 0
    starts = ((t[1:] == 1) & (t[:-1] == 0)).sum().item()
    assert starts == 4  # images at 65, 363, 661, 959 (the last one cut at the end)


def test_cpu_sweep_rows_and_agreement():
    seen = []
    rows = run_mask_sweep(
        [96, 200],
        [0, 40],
        window=64,
        impls=("dense", "triton"),
        repeats=2,
        warmup=1,
        device="cpu",
        write_bw_bytes_s=1e9,
        image_tokens=40,
        on_row=seen.append,
    )
    assert len(rows) == 8 and seen == rows
    for r in rows:
        q, p = r["shape"]["q_len"], r["shape"]["prefix_len"]
        assert r["status"] == "ok", r["message"]
        assert r["output_bytes"] == q * (p + q)
        assert r["bound_ms"] == pytest.approx(q * (p + q) / 1e9 * 1e3)
        assert r["peak_allocated_bytes"] is None and r["memory_available"] is False
        assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["x_bound"] == pytest.approx(r["median_ms"] / r["bound_ms"])
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["shape"]["q_len"], r["shape"]["prefix_len"]), set()).add(r["true_count"])
    assert all(len(counts) == 1 for counts in by_shape.values())  # dense and triton agree


def test_cpu_budget_skips_predicted_overflow():
    rows = run_mask_sweep(
        [128], [0], window=32, impls=("dense", "triton"), budget_gib=40_000 / 2**30, repeats=1, warmup=0, device="cpu"
    )
    dense, triton = rows
    assert dense["status"] == "skipped" and "budget" in dense["message"]  # 3 * 128^2 = 49152 B > 40000 B
    assert triton["status"] == "ok"  # 128^2 + 4 * 128 + 64 B fits


def test_oom_is_recorded_and_the_sweep_continues(monkeypatch):
    real = gm.build_gemma_attention_mask

    def fake(types, q, p, w, impl="triton"):
        if impl == "dense":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return real(types, q, p, w, impl=impl)

    monkeypatch.setattr(gm, "build_gemma_attention_mask", fake)
    rows = run_mask_sweep([64, 80], [16], window=None, impls=("dense", "triton"), repeats=1, warmup=0, device="cpu")
    assert [r["status"] for r in rows] == ["oom", "ok", "oom", "ok"]
    assert rows[0]["message"].startswith("CUDA out of memory") and rows[0]["median_ms"] is None


def test_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        run_mask_sweep([8], impls=("sparse",), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_budget_makes_dense_oom_and_triton_fit(request):
    if not in_fresh_process(request):  # reserved memory / a budget: the allocator's state matters
        return
    # Q = 16384, P = 0: dense peak 768 MiB, triton 256 MiB; budget 0.5 GiB.
    rows = run_mask_sweep([16384], [0], window=1024, impls=("dense", "triton"), budget_gib=0.5, repeats=3)
    dense, triton = rows
    assert dense["status"] == "oom", dense
    assert triton["status"] == "ok", triton
    assert triton["output_bytes"] <= triton["peak_allocated_bytes"] <= triton["predicted_peak_bytes"] + 2048
    # the cap is lifted afterwards: dense fits again
    again = run_mask_sweep([16384], [0], window=1024, impls=("dense",), repeats=1)
    assert again[0]["status"] == "ok" and again[0]["peak_allocated_bytes"] >= again[0]["predicted_peak_bytes"]


def test_cli_kernels_mask_writes_a_result(tmp_path):
    from typer.testing import CliRunner

    from perfkit.cli import app
    from perfkit.results import read_result

    args = ["kernels", "mask", "--q-lens", "64", "--prefix-lens", "0,16", "--window", "32", "--repeats", "1"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (run_dir,) = tmp_path.iterdir()
    result = read_result(run_dir)
    assert result.status == "complete" and len(result.kernels) == 4
    assert {k.impl for k in result.kernels} == {"dense", "triton"} and all(k.status == "ok" for k in result.kernels)
    bad = CliRunner().invoke(app, ["kernels", "mask", "--q-lens", "8x", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "--q-lens" in bad.output
