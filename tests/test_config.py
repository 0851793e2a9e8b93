"""Strict config loading: every class of bad input is one exact line and exit code 2."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from perfkit.cli import app
from perfkit.config import apply_overrides, config_schema, load_config, load_raw, substitute_env
from perfkit.errors import PerfkitError

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = {"name": "t", "scenarios": [{"name": "a", "workload": {"isl": 128, "osl": 16}, "num_requests": 4}]}


def _write(tmp_path: Path, data: dict | str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def _validate(tmp_path: Path, data: dict | str, *extra: str):
    p = _write(tmp_path, data)
    return CliRunner().invoke(app, ["config", "validate", str(p), *extra]), p


def test_every_shipped_config_validates():
    files = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(files) > 0
    for f in files:
        cfg = load_config(f)
        assert cfg.scenarios


def test_cli_validates_shipped_configs():
    files = [str(f) for f in sorted((ROOT / "configs").rglob("*.yaml"))]
    res = CliRunner().invoke(app, ["config", "validate", *files])
    assert res.exit_code == 0, res.output
    assert res.output.count("ok: ") == len(files)


@pytest.mark.parametrize(
    "patch, line",
    [
        ({"runtim": {}}, "runtim: unknown key; allowed keys here: name, description, model, models, runtime, toggles, "
         "arms, repeats, scenarios, capture, output"),
        ({"toggles": {"mask": "fast"}}, "toggles.mask: Input should be 'triton' or 'dense' (got 'fast')"),
        ({"runtime": {"max_batch_size": "many"}},
         "runtime.max_batch_size: Input should be a valid integer, unable to parse string as an integer (got 'many')"),
        ({"scenarios": [{"name": "a", "workload": {"isl": -5, "osl": 16}, "num_requests": 4}]},
         "scenarios[0].workload.isl.mean: Input should be greater than or equal to 1 (got -5)"),
        ({"scenarios": [{"name": "a", "workload": {"isl": 8, "osl": 16}, "num_requests": 4,
                         "arrival": {"kind": "closed", "concurrency": 0}}]},
         "scenarios[0].arrival.concurrency: Input should be greater than or equal to 1 (got 0)"),
        ({"model": {"sliding_window": 65536}},
         "model.sliding_window (65536) is larger than the context runtime.max_model_len (32768); "
         "use a window <= max_model_len"),
        ({"scenarios": [{"name": "a", "workload": {"isl": 40000, "osl": 16}, "num_requests": 4}]},
         "scenarios[0] (a) needs up to 40016 tokens of context (prefix + isl + images + osl) but "
         "runtime.max_model_len is 32768; raise max_model_len or shorten the workload"),
        ({"arms": [{"name": "x", "toggles": {"page_table": "gpu"}}]},
         "arms[0].toggles.page_table: Input should be 'host' or 'padded' (got 'gpu')"),
        ({"scenarios": [{"name": "a", "workload": {"isl": 8, "osl": 16}, "num_requests": 4,
                         "arrival": {"kind": "poisson"}}]},
         "scenarios[0].arrival: Input tag 'poisson' found using 'kind' does not match any of the expected tags: "
         "'closed', 'rate', 'all_at_once'"),
        ({"scenarios": [{"name": "a", "workload": {"isl": 8, "osl": 16}}]},
         "scenarios[0]: set num_requests and/or duration_s"),
    ],
)
def test_invalid_config_is_one_exact_line_and_exit_2(tmp_path, patch, line):
    res, p = _validate(tmp_path, {**MINIMAL, **patch})
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"error: {p}: {line}"]
    assert "Traceback" not in res.output


def test_several_problems_are_several_lines(tmp_path):
    res, p = _validate(tmp_path, {**MINIMAL, "toggles": {"mask": "x", "page_table": "y"}, "repeats": 0})
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 3


def test_malformed_yaml_and_missing_file(tmp_path):
    res, p = _validate(tmp_path, "name: [unclosed\n")
    assert res.exit_code == 2 and res.output.startswith(f"error: {p}: line 2") and "not valid YAML" in res.output
    res = CliRunner().invoke(app, ["config", "validate", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 2 and res.output.strip() == f"error: config file not found: {tmp_path / 'nope.yaml'}"


def test_yaml_on_off_toggles_are_strings():
    cfg = load_raw({**MINIMAL, "toggles": {"cuda_graphs": False, "mm_embed_cache": True}}, "t")
    assert cfg.toggles.cuda_graphs == "off" and cfg.toggles.mm_embed_cache == "on"


def test_env_substitution():
    env = {"BS": "64", "NAME": "run1"}
    out = substitute_env({"a": "${BS:8}", "b": "${MISSING:7}", "c": "x-${NAME}", "d": ["${BS}"]}, env)
    assert out == {"a": 64, "b": 7, "c": "x-run1", "d": [64]}
    with pytest.raises(PerfkitError, match="MISSING is not set"):
        substitute_env({"a": "${MISSING}"}, env)


def test_set_overrides(tmp_path):
    p = _write(tmp_path, MINIMAL)
    cfg = load_config(p, ["runtime.max_batch_size=7", "scenarios.0.arrival.concurrency=3", "toggles.mask=dense"])
    assert cfg.runtime.max_batch_size == 7 and cfg.scenarios[0].arrival.concurrency == 3
    assert cfg.toggles.mask == "dense"
    with pytest.raises(PerfkitError, match="not an index"):
        apply_overrides({"scenarios": [{}]}, ["scenarios.5.name=x"])
    res = CliRunner().invoke(app, ["config", "validate", str(p), "--set", "runtime.page_size=0"])
    assert res.exit_code == 2
    assert res.output.strip() == f"error: {p}: runtime.page_size: Input should be greater than or equal to 1 (got 0)"


def test_arms_resolve_on_top_of_toggles():
    cfg = load_raw({**MINIMAL, "toggles": {"mask": "triton"},
                    "arms": [{"name": "A", "toggles": {"mask": "dense"}}, {"name": "B"}]}, "t")
    arms = dict(cfg.arm_list())
    assert arms["A"].mask == "dense" and arms["B"].mask == "triton"
    assert load_raw(MINIMAL, "t").arm_list()[0][0] == "default"


def test_schema_command():
    res = CliRunner().invoke(app, ["config", "schema"])
    assert res.exit_code == 0
    assert '"title": "perfkit run config"' in res.output and config_schema()["properties"]["scenarios"]


def test_resolve_toggles_auto_fused_kernels_and_refusals(monkeypatch):
    from perfkit.config import Toggles
    from perfkit.runners.suite import resolve_toggles

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = resolve_toggles(Toggles(), "cpu")
    assert cpu.fused_kernels == "off" and cpu.attention == "torch" and cpu.cuda_graphs == "off"
    assert resolve_toggles(Toggles(attention="torch"), "cuda").fused_kernels == "on"  # auto: the fast path on a GPU
    assert resolve_toggles(Toggles(fused_kernels="off", attention="torch"), "cuda").fused_kernels == "off"
    with pytest.raises(PerfkitError, match="fused_kernels=on needs a CUDA GPU"):
        resolve_toggles(Toggles(fused_kernels="on"), "cpu")


def test_scenario_models_narrow_a_several_model_suite(tmp_path):
    """`models:` on a scenario runs it on those of the suite's models only; a name outside the suite is one line."""
    models = [{"preset": "tiny", "dtype": "float32"}, {"preset": "tiny-moe", "dtype": "float32"}]
    scen = [{"name": "a", "workload": {"isl": 8, "osl": 4}, "num_requests": 2},
            {"name": "b", "workload": {"isl": 8, "osl": 4}, "num_requests": 2, "models": ["tiny-moe"]},
            {"name": "h", "runner": "hf", "workload": {"isl": 8, "osl": 4}, "num_requests": 2, "models": ["tiny"]}]
    cfg = load_config(_write(tmp_path, {"name": "t", "models": models, "scenarios": scen}))
    assert [s.name for s in cfg.scenarios_of("tiny", "engine")] == ["a"]
    assert [s.name for s in cfg.scenarios_of("tiny-moe", "engine")] == ["a", "b"]
    assert [s.name for s in cfg.scenarios_of("tiny", "hf")] == ["h"] and not cfg.scenarios_of("tiny-moe", "hf")
    scen[1]["models"] = ["31b", "tiny"]
    res, p = _validate(tmp_path, {"name": "t", "models": models, "scenarios": scen})
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: {p}: scenario b: models 31b are not in the suite; allowed: tiny, tiny-moe"]
