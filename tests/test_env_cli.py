"""`perfkit env`, `perfkit toggles`, `perfkit --help` on a CPU machine."""

import json

from typer.testing import CliRunner

from perfkit.cli import app
from perfkit.provenance import gpu_info


def test_help_lists_commands():
    res = CliRunner().invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("run", "config", "env", "toggles"):
        assert cmd in res.output


def test_env_json_has_provenance():
    res = CliRunner().invoke(app, ["env", "--json"])
    assert res.exit_code == 0
    info = json.loads(res.output)
    assert set(info) >= {"git", "python", "packages", "gpu"}
    assert "torch" in info["packages"] and "sha" in info["git"]


def test_env_text_says_when_there_is_no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(app, ["env"])
    assert res.exit_code == 0 and "GPU: none (no CUDA GPU visible to torch)" in res.output


def test_gpu_info_with_fake_nvml(monkeypatch):
    import torch

    class Props:
        multi_processor_count, major, minor, total_memory = 132, 9, 0, 141 * 2**30

    class Mem:
        total = 141 * 2**30

    class FakeNVML:
        NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 2

        def nvmlInit(self): ...
        def nvmlShutdown(self): ...
        def nvmlDeviceGetHandleByIndex(self, i): return "h"
        def nvmlDeviceGetName(self, h): return b"NVIDIA H200"
        def nvmlSystemGetDriverVersion(self): return "580.1"
        def nvmlSystemGetCudaDriverVersion(self): return 13000
        def nvmlDeviceGetMemoryInfo(self, h): return Mem()
        def nvmlDeviceGetMaxClockInfo(self, h, c): return 1980 if c == 0 else 3201
        def nvmlDeviceGetClockInfo(self, h, c): return 1755
        def nvmlDeviceGetPowerManagementLimit(self, h): return 700000
        def nvmlDeviceGetPersistenceMode(self, h): raise RuntimeError("not supported")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    info = gpu_info(FakeNVML())
    assert info["name"] == "NVIDIA H200" and info["driver"] == "580.1" and info["cuda_driver"] == "13.0"
    assert info["power_limit_w"] == 700.0 and info["sm_count"] == 132 and info["persistence_mode"] is None


def test_toggles_lists_every_toggle():
    res = CliRunner().invoke(app, ["toggles"])
    assert res.exit_code == 0
    for name in ("mask", "page_table", "mm_embed_cache", "cuda_graphs", "attention", "moe_gather"):
        assert name in res.output


def test_launcher_commit_wins_over_a_stale_git(monkeypatch):
    """A copy of the tree sent to a GPU machine may carry an old .git: PERFKIT_GIT_SHA names the real commit."""
    from perfkit.provenance import git_info

    monkeypatch.setenv("PERFKIT_GIT_SHA", "0123456789abcdef")
    monkeypatch.setenv("PERFKIT_GIT_DIRTY", "1")
    assert git_info() == {"sha": "0123456789abcdef", "short": "0123456789", "dirty": True, "source": "PERFKIT_GIT_SHA"}
    monkeypatch.delenv("PERFKIT_GIT_SHA")
    assert git_info().get("source") is None
