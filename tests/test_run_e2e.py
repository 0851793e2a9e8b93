"""End-to-end `perfkit run` on the tiny model (CPU, torch attention): schema-valid results with every section,
and the OOM / error / Ctrl-C paths losing no finished scenario."""

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from perfkit.cli import app
from perfkit.results import read_requests, read_result
from perfkit.runners import serving

ROOT = Path(__file__).resolve().parent.parent


def _small_config(tmp_path: Path, scenarios: list[dict] | None = None, **extra) -> Path:
    cfg = {
        "name": "e2e",
        "model": {"preset": "tiny", "dtype": "float32", "device": "cpu"},
        "runtime": {"max_batch_size": 8, "max_num_tokens": 256, "max_model_len": 1024},
        "toggles": {"attention": "torch"},
        "scenarios": scenarios
        or [
            {"name": "a", "workload": {"isl": 24, "osl": 4}, "arrival": {"concurrency": 2}, "num_requests": 3},
            {"name": "b", "workload": {"isl": 16, "osl": 3}, "arrival": {"concurrency": 1}, "num_requests": 2},
            {"name": "c", "workload": {"isl": 8, "osl": 2}, "arrival": {"kind": "all_at_once"}, "num_requests": 2},
        ],
        **extra,
    }
    p = tmp_path / "e2e.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_smoke_config_end_to_end(tmp_path):
    res = CliRunner().invoke(
        app, ["run", str(ROOT / "configs" / "smoke.yaml"), "--out", str(tmp_path), "--set", "model.dtype=float32"]
    )
    assert res.exit_code == 0, res.output
    run_dir = next(tmp_path.iterdir())
    result = read_result(run_dir)
    assert result.status == "complete" and result.schema_version == 1
    assert [s.name for s in result.scenarios] == ["text_c4", "mm_prefill"]
    for s in result.scenarios:
        assert s.status == "ok", s.message
        assert s.counts.requests > 0
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms"):
            assert s.metrics[m].n > 0 and s.metrics[m].p50 is not None
        assert s.throughput.output_tok_s > 0
        assert s.memory is not None and s.memory.available is False and s.memory.reason
        assert s.telemetry is not None and s.telemetry.available is False
        assert s.roofline is not None and s.nvtx and "step" in s.nvtx and "forward_prefill" in s.nvtx
        assert s.arm["attention"] == "torch" and s.arm["cuda_graphs"] == "off"
        assert s.runtime["jit_compiles"]["compiles"] == 0 and s.message is None  # no Triton kernel built on a CPU
        assert s.runtime["warmup_jit_compiles"] == {"compiles": 0, "seconds": 0}
    text, mm = result.scenarios
    assert text.counts.requests == 12 and text.counts.input_vision_tokens == 0
    assert text.throughput.goodput_fraction is not None
    assert mm.counts.input_vision_tokens == 2 * 2 * 70  # 2 requests x 2 images x 70 soft tokens
    lines = read_requests(run_dir)
    assert len(lines) == 14 and {line["scenario"] for line in lines} == {"text_c4", "mm_prefill"}
    assert "result:" in res.output


def test_arms_interleave_and_repeat(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # other test modules turn the interpreter on
    p = _small_config(
        tmp_path,
        scenarios=[{"name": "a", "workload": {"isl": 12, "osl": 3}, "arrival": {"concurrency": 2}, "num_requests": 2}],
        arms=[
            {"name": "padded", "toggles": {"page_table": "padded"}},
            {"name": "host", "toggles": {"page_table": "host"}},
        ],
        repeats=2,
    )
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    result = read_result(next((tmp_path / "r").iterdir()))
    assert [(s.arm_name, s.repeat) for s in result.scenarios] == [
        ("padded", 0),
        ("host", 0),
        ("padded", 1),
        ("host", 1),
    ]
    assert [s.arm["page_table"] for s in result.scenarios] == ["padded", "host", "padded", "host"]
    assert all(s.arm["mask"] == "dense" for s in result.scenarios)  # no Triton on a CPU: recorded as what ran


def test_profile_window_per_arm_and_repeat(tmp_path, monkeypatch):
    """--profile python on an A/B with repeats: every (arm, repeat) run gets its own summary in runtime.profile
    and its own file (they used to share <scenario>.pstats, the last run's overwriting the others)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = _small_config(
        tmp_path,
        scenarios=[{"name": "a", "workload": {"isl": 12, "osl": 6}, "arrival": {"concurrency": 2}, "num_requests": 2}],
        arms=[
            {"name": "padded", "toggles": {"page_table": "padded"}},
            {"name": "host", "toggles": {"page_table": "host"}},
        ],
        repeats=2,
        capture={"profile_steps": [1, 3]},
    )
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r"), "--profile", "python"])
    assert res.exit_code == 0, res.output
    runs = read_result(next((tmp_path / "r").iterdir())).scenarios
    traces = [Path(s.runtime["profile_trace"]) for s in runs]
    assert [t.name for t in traces] == [
        "a.padded.r0.pstats",
        "a.host.r0.pstats",
        "a.padded.r1.pstats",
        "a.host.r1.pstats",
    ]
    assert all(t.is_file() for t in traces)
    assert all(s.runtime["profile"]["steps"] == 2 and s.runtime["profile"]["top"] for s in runs)


def test_oom_and_error_are_recorded_and_the_run_continues(tmp_path, monkeypatch):
    real = serving.ServingTarget.run_scenario

    def flaky(self, scenario, base, toggles, on_progress=None):
        if scenario.name == "a":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if scenario.name == "b":
            raise RuntimeError("kernel exploded")
        return real(self, scenario, base, toggles, on_progress)

    monkeypatch.setattr(serving.ServingTarget, "run_scenario", flaky)
    p = _small_config(tmp_path)
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r")])
    assert res.exit_code == 1, res.output  # some scenario failed
    run_dir = next((tmp_path / "r").iterdir())
    result = read_result(run_dir)
    assert [(s.name, s.status) for s in result.scenarios] == [("a", "oom"), ("b", "error"), ("c", "ok")]
    assert "out of memory" in result.scenarios[0].message and "kernel exploded" in result.scenarios[1].message
    assert "kernel exploded" in (run_dir / "errors.log").read_text()
    assert result.status == "complete"


def test_ctrl_c_keeps_finished_scenarios_and_exits_130(tmp_path, monkeypatch):
    real = serving.ServingTarget.run_scenario

    def interrupted(self, scenario, base, toggles, on_progress=None):
        if scenario.name == "b":
            raise KeyboardInterrupt
        return real(self, scenario, base, toggles, on_progress)

    monkeypatch.setattr(serving.ServingTarget, "run_scenario", interrupted)
    p = _small_config(tmp_path)
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r")])
    assert res.exit_code == 130, res.output
    run_dir = next((tmp_path / "r").iterdir())
    result = read_result(run_dir)
    assert result.status == "interrupted" and [s.name for s in result.scenarios] == ["a"]
    assert result.scenarios[0].status == "ok" and len(read_requests(run_dir)) == 3


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "toggles.attention=flashinfer",
            "error: toggles.attention=flashinfer cannot run here: no CUDA device; use attention: torch or auto",
        ),
        (
            "toggles.pdl=on",
            "error: toggles.pdl=on needs a CUDA GPU of compute capability 9.0 or newer (programmatic dependent "
            "launch); use pdl: off or auto",
        ),
        (
            "model.device=cuda",
            "error: model.device is cuda but no CUDA GPU is visible; run on a GPU machine or use --set model.device=auto",
        ),
    ],
)
def test_impossible_run_is_one_line_exit_2(tmp_path, override, line):
    p = _small_config(tmp_path)
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r"), "--set", override])
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == line


def test_nvtx_toggle_switches_capture_per_arm(tmp_path):
    p = _small_config(
        tmp_path,
        scenarios=[{"name": "a", "workload": {"isl": 12, "osl": 3}, "arrival": {"concurrency": 2}, "num_requests": 2}],
        arms=[{"name": "capture_off", "toggles": {"nvtx": "off"}}, {"name": "capture_on", "toggles": {"nvtx": "on"}}],
    )
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    off, on = read_result(next((tmp_path / "r").iterdir())).scenarios
    assert off.arm["nvtx"] == "off" and off.nvtx == {}
    assert on.arm["nvtx"] == "on" and {"step", "forward_decode", "sample"} <= set(on.nvtx)
    assert off.counts.output_tokens == on.counts.output_tokens == 6


def test_moe_gather_arms_run_and_are_recorded(tmp_path):
    """configs/ab_moe_gather.yaml's shape on a CPU: a tiny-moe NVFP4 model with moe_gather gemv and kernels arms
    runs both and records each arm's value (the interpreter's fp32 activations keep both on the gemv gather; the
    kernels' numerics are tested in test_quant.py)."""
    p = _small_config(
        tmp_path,
        scenarios=[{"name": "a", "workload": {"isl": 12, "osl": 3}, "arrival": {"concurrency": 2}, "num_requests": 2}],
        arms=[
            {"name": "gemv", "toggles": {"moe_gather": "gemv"}},
            {"name": "kernels", "toggles": {"moe_gather": "kernels"}},
        ],
    )
    res = CliRunner().invoke(
        app,
        ["run", str(p), "--out", str(tmp_path / "r"), "--set", "model.preset=tiny-moe", "--set", "model.quant=nvfp4"],
    )
    assert res.exit_code == 0, res.output
    gemv, kernels = read_result(next((tmp_path / "r").iterdir())).scenarios
    assert gemv.status == kernels.status == "ok"
    assert (gemv.arm["moe_gather"], kernels.arm["moe_gather"]) == ("gemv", "kernels")


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_quantized_weights_run_and_say_which_path(tmp_path, scheme):
    p = _small_config(
        tmp_path,
        scenarios=[{"name": "a", "workload": {"isl": 12, "osl": 3}, "arrival": {"concurrency": 2}, "num_requests": 2}],
    )
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r"), "--set", f"model.quant={scheme}"])
    assert res.exit_code == 0, res.output
    assert f"quant: {scheme}" in res.output or "quant: NVFP4" in res.output
    (s,) = read_result(next((tmp_path / "r").iterdir())).scenarios
    q = s.runtime["quant"]
    assert s.status == "ok" and q["scheme"] == scheme and q["quant_backend"]
    assert q["quantized_bytes_after"] < q["quantized_bytes_before"]


def test_scenario_models_run_on_their_models_only(tmp_path):
    """A several-model suite runs a scenario with `models:` on those models only, in suite order."""
    p = _small_config(
        tmp_path,
        scenarios=[{"name": "a", "workload": {"isl": 8, "osl": 2}, "num_requests": 1},
                   {"name": "b", "workload": {"isl": 8, "osl": 2}, "num_requests": 1, "models": ["tiny-moe"]}],
        models=[{"preset": "tiny", "dtype": "float32", "device": "cpu"},
                {"preset": "tiny-moe", "dtype": "float32", "device": "cpu"}],
    )  # fmt: skip
    res = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    result = read_result(next((tmp_path / "r").iterdir()))
    assert [s.name for s in result.scenarios] == ["tiny/a", "tiny-moe/a", "tiny-moe/b"]
    assert all(s.status == "ok" for s in result.scenarios)


def test_engine_warm_up_is_best_effort():
    """The runner's per-arm Engine.warm_up (CUDA only) returns its prefill sizes; an out-of-memory prefill (an arm's
    toggles that need more activations than the first arm left beside the KV pool) drops its requests and lets the
    arm run, reported as "out of memory" in runtime.warmup_prefill_tokens, instead of failing it."""
    from types import SimpleNamespace

    calls = []

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    engine = SimpleNamespace(warm_up=lambda: [64, 63], abort_all=lambda: calls.append("abort"))
    target = serving.ServingTarget(None, None, "cpu", Path("."), None, engine, None, None,
                                   SimpleNamespace(reset=lambda: calls.append("reset")), None, None)  # fmt: skip
    assert target._warm_up_engine() == [64, 63] and calls == []
    engine.warm_up = oom
    assert target._warm_up_engine() == "out of memory" and calls == ["abort", "reset"]
