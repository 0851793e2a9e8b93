"""`perfkit run CONFIG --tp 2` end to end on the CPU (gloo, loopback only): the real CLI relaunches itself
through torchrun, each rank runs its shard with rank 0 driving the schedule, and rank 0 alone writes one run
directory whose numbers match the TP=1 run of the same config. Plus the per-scenario status agreement and the
HF-peer refusal, with a stand-in for the process group."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from perfkit.cli import app
from perfkit.config import load_config
from perfkit.errors import PerfkitError
from perfkit.results import Counts, ScenarioResult, read_requests, read_result
from perfkit.runners import suite

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = [
    {"name": "c2", "workload": {"isl": 24, "osl": 5, "seed": 1}, "arrival": {"kind": "closed", "concurrency": 2},
     "num_requests": 4, "warmup_requests": 1},
    {"name": "open", "workload": {"isl": {"dist": "uniform", "mean": 16, "range_ratio": 0.5}, "osl": 4, "seed": 2},
     "arrival": {"kind": "rate", "rate": 50.0}, "num_requests": 3},
]  # fmt: skip


def _config(tmp_path: Path, scenarios: list[dict] = SCENARIOS) -> Path:
    cfg = {
        "name": "tprun",
        "model": {"preset": "tiny", "dtype": "float32", "device": "cpu"},
        "runtime": {"max_batch_size": 8, "max_num_tokens": 256, "max_model_len": 1024},
        "toggles": {"attention": "torch"},
        "scenarios": scenarios,
    }
    p = tmp_path / "tprun.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def test_tp2_run_through_the_cli_matches_tp1(tmp_path):
    cfg = _config(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "perfkit", "run", str(cfg), "--tp", "2", "--out", str(tmp_path / "tp2")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "tp2").iterdir())
    assert len(runs) == 1 and sorted(p.name for p in runs[0].iterdir()) == ["requests.jsonl", "result.json"]
    assert proc.stdout.count("result: ") == 1  # rank 0 alone prints
    tp2 = read_result(runs[0])

    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "tp1")])
    assert res.exit_code == 0, res.output
    run1 = next((tmp_path / "tp1").iterdir())
    tp1 = read_result(run1)

    assert tp2.status == "complete" and tp2.config["runtime"]["tensor_parallel"] == 2
    par = tp2.provenance["parallel"]
    assert par["world_size"] == par["tp"] == 2 and par["backend"] == "gloo" and par["devices"] == ["cpu", "cpu"]
    assert par["env"] == {"NCCL_NVLS_ENABLE": "0"}
    assert "parallel" not in tp1.provenance
    assert [s.name for s in tp2.scenarios] == [s.name for s in tp1.scenarios] == ["c2", "open"]
    for s2, s1 in zip(tp2.scenarios, tp1.scenarios, strict=True):
        assert s2.status == s1.status == "ok", (s2.message, s1.message)
        t = s2.runtime["tp"]
        assert t["tp_world_size"] == 2 and t["kv_heads_per_rank"] == {"sliding": 1, "full": 1}
        assert t["vocab_rows_per_rank"] * 2 == s1.runtime["tp"]["vocab_rows_per_rank"]
        assert s1.runtime["tp"]["tp_world_size"] == 1
        assert s2.throughput.output_tok_s_per_gpu == pytest.approx(s2.throughput.output_tok_s / 2)
        assert s2.throughput.total_tok_s_per_gpu == pytest.approx(s2.throughput.total_tok_s / 2)
        assert s1.throughput.output_tok_s_per_gpu == pytest.approx(s1.throughput.output_tok_s)
        assert s2.counts.model_dump(exclude={"duration_s"}) == s1.counts.model_dump(exclude={"duration_s"})
        assert s2.counts.output_tokens > 0 and s2.counts.preemptions == 0
    # the closed loop is deterministic: the same engine steps as TP=1 (open-loop batching depends on the clock)
    assert tp2.scenarios[0].runtime["steps"] == tp1.scenarios[0].runtime["steps"]

    def per_request(run_dir: Path) -> list[tuple]:
        return sorted((r["scenario"], r["request_id"], r["input_text_tokens"], r["output_tokens"], len(r["token_ns"]))
                      for r in read_requests(run_dir))  # fmt: skip

    assert per_request(runs[0]) == per_request(run1) and len(per_request(run1)) == 7

    # compare picks up the per-GPU rows (higher is better)
    out = CliRunner().invoke(app, ["compare", str(run1), str(runs[0]), "--metrics", "output_tok_s_per_gpu"])
    assert out.exit_code == 0, out.output
    assert "output throughput / GPU" in out.output


class FakeTP:
    """A stand-in TPContext for rank 0 of 2: every other rank reports `others`."""

    def __init__(self, others=None):
        self.rank, self.world_size, self.backend, self.is_rank0 = 0, 2, "fake", True
        self.device = torch.device("cpu")
        self.others = others
        self.shut = False

    def all_gather_object(self, obj):
        return [obj, obj if self.others is None else self.others]

    def broadcast_object(self, obj, src=0):
        return obj

    def min_int(self, v):
        return v

    def shutdown(self):
        self.shut = True


def _res(status="ok", out=8, msg=None) -> ScenarioResult:
    counts = Counts(requests=2, input_text_tokens=10, input_vision_tokens=0, output_tokens=out, duration_s=1.0)
    return ScenarioResult(name="s", arm={}, status=status, message=msg, counts=counts, runtime={"steps": 5})


def test_a_failure_on_another_rank_fails_the_scenario_on_rank0():
    target = SimpleNamespace(recovered=0)
    target.recover = lambda: setattr(target, "recovered", target.recovered + 1)
    oom = FakeTP(("oom", "OutOfMemoryError: CUDA out of memory", None, None))
    res, lines = suite._agree(oom, target, _res(), [{"request_id": 0}])
    assert res.status == "oom" and res.message.startswith("rank 1: OutOfMemoryError") and lines == []
    assert target.recovered == 1  # rank 0 drops its requests too: the engines stay identical
    res, lines = suite._agree(FakeTP(), target, _res(), [{"request_id": 0}])
    assert res.status == "ok" and lines == [{"request_id": 0}] and target.recovered == 1
    res, _ = suite._agree(FakeTP(("ok", None, 9, 5)), target, _res(), [])
    assert res.status == "error" and "diverged" in res.message and "rank 1: 9 tokens" in res.message
    res, _ = suite._agree(FakeTP(("ok", None, 8, 5)), target, _res("error", msg="ValueError: x"), [])
    assert res.status == "error" and res.message == "rank 0: ValueError: x" and target.recovered == 2


def test_hf_scenarios_are_recorded_not_run_under_tp(tmp_path, monkeypatch):
    hf = {"name": "hf_c1", "runner": "hf", "workload": {"isl": 8, "osl": 2}, "arrival": {"concurrency": 1},
          "num_requests": 1}  # fmt: skip
    cfg = load_config(_config(tmp_path, [hf]), ["runtime.tensor_parallel=2"])
    fake = FakeTP()
    monkeypatch.setattr(suite, "_init_tp", lambda cfg, devices: fake)
    monkeypatch.setattr(suite, "_load", lambda *a, **k: pytest.fail("nothing is loaded for an hf scenario"))
    code = suite.run_suite(cfg, tmp_path / "out", "perfkit run", Console(quiet=True))
    assert code == 1 and fake.shut
    (s,) = read_result(next((tmp_path / "out").iterdir())).scenarios
    assert s.status == "error" and s.runner == "hf" and "not run under tensor parallelism (TP=2)" in s.message


def test_tensor_parallel_outside_torchrun_is_a_one_line_error(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(_config(tmp_path), ["runtime.tensor_parallel=2"])
    with pytest.raises(PerfkitError, match="perfkit run CONFIG --tp 2"):
        suite.run_suite(cfg, tmp_path / "out", "perfkit run", Console(quiet=True))
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(app, ["run", str(_config(tmp_path)), "--tp", "0"])
    assert res.exit_code == 2 and "--tp 0: must be >= 1" in res.output
    assert json.loads(json.dumps(load_config(_config(tmp_path)).runtime.tensor_parallel)) == 1
