"""Synthetic result files for compare/plot tests: fixed numbers or seeded draws, no runtime needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from perfkit.results import (
    Counts,
    KernelRow,
    MemorySection,
    PhaseMemory,
    RangeStats,
    Result,
    ScenarioResult,
    Throughput,
    WorkloadInfo,
    write_result,
)
from perfkit.stats import summarize

GIB = 2**30


def provenance(
    gpu: str = "NVIDIA H200",
    driver: str = "570.86.15",
    sha: str = "abc1234def",
    dirty: bool = False,
    torch: str = "2.11.0",
) -> dict[str, Any]:
    return {
        "git": {"sha": sha + "0" * (40 - len(sha)), "short": sha[:10], "dirty": dirty},
        "packages": {"perfkit": "0.1.0", "torch": torch, "triton": "3.6.0", "numpy": "2.4.6"},
        "gpu": {"available": True, "name": gpu, "driver": driver, "cuda_driver": "12.8", "device_count": 1},
    }


def config(preset: str = "31b", quant: str = "bf16", scenarios: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "name": "synthetic",
        "model": {"preset": preset, "quant": quant, "dtype": "bfloat16", "weights": "random"},
        "scenarios": scenarios or [{"name": "decode", "arrival": {"kind": "closed", "concurrency": 8}}],
    }


def requests_for(
    scenario: str, arm: str, repeat: int, ttft: np.ndarray, tpot: np.ndarray, n_out: int = 8, t0_ns: int = 0
) -> list[dict[str, Any]]:
    """Per-request lines with evenly spaced tokens (so ITL = TPOT for each request)."""
    out = []
    for i, (f, p) in enumerate(zip(ttft, tpot, strict=True)):
        submit = t0_ns + i * 1_000_000
        first = submit + int(round(f * 1e6))
        tokens = [first + int(round(k * p * 1e6)) for k in range(n_out)]
        out.append(
            {
                "scenario": scenario,
                "arm": arm,
                "repeat": repeat,
                "request_id": f"{arm}-{repeat}-{i}",
                "input_text_tokens": 128,
                "input_vision_tokens": 0,
                "output_tokens": n_out,
                "submit_ns": submit,
                "scheduled_ns": submit,
                "first_token_ns": first,
                "last_token_ns": tokens[-1],
                "token_ns": tokens,
                "ttft_ms": float(f),
                "tpot_ms": float(p),
                "e2el_ms": (tokens[-1] - submit) / 1e6,
                "queue_ms": 0.0,
            }
        )
    return out


def scenario_from_requests(
    name: str,
    arm: str,
    repeat: int,
    reqs: list[dict[str, Any]],
    *,
    toggles: dict[str, str] | None = None,
    workload_hash: str = "w0",
    memory: dict[str, tuple[int, int]] | None = None,
    nvtx: dict[str, tuple[float, float | None]] | None = None,
    status: str = "ok",
) -> ScenarioResult:
    ttft = [r["ttft_ms"] for r in reqs]
    tpot = [r["tpot_ms"] for r in reqs]
    e2el = [r["e2el_ms"] for r in reqs]
    itl = np.concatenate([np.diff(r["token_ns"]) / 1e6 for r in reqs]) if reqs else np.array([])
    n_out = sum(r["output_tokens"] for r in reqs)
    n_in = sum(r["input_text_tokens"] for r in reqs)
    dur = sum(e2el) / 8 / 1e3 if reqs else 1.0  # as if closed-loop at concurrency 8 (Little's law)
    return ScenarioResult(
        name=name,
        arm_name=arm,
        arm=toggles or {"mask": arm},
        repeat=repeat,
        status=status,  # type: ignore[arg-type]
        workload=WorkloadInfo(spec={"osl": 8}, hash=workload_hash),
        counts=Counts(
            requests=len(reqs), input_text_tokens=n_in, input_vision_tokens=0, output_tokens=n_out, duration_s=dur
        ),
        metrics={
            "ttft_ms": summarize(ttft),
            "tpot_ms": summarize(tpot),
            "itl_ms": summarize(itl),
            "e2el_ms": summarize(e2el),
            "queue_ms": summarize([0.0] * len(reqs)),
            "per_user_tok_s": summarize([1000.0 / t for t in tpot]),
        },
        throughput=Throughput(output_tok_s=n_out / dur, total_tok_s=(n_out + n_in) / dur, request_s=len(reqs) / dur),
        memory=MemorySection(
            available=True,
            phases={
                k: PhaseMemory(peak_allocated_bytes=v[0], peak_reserved_bytes=v[1]) for k, v in (memory or {}).items()
            },
        ),
        nvtx={
            k: RangeStats(
                count=10,
                host_total_ms=10 * h,
                host_mean_ms=h,
                host_p50_ms=h,
                host_p99_ms=h * 1.2,
                device_total_ms=None if d is None else 10 * d,
                device_mean_ms=d,
                device_p50_ms=d,
                device_p99_ms=None if d is None else d * 1.1,
            )
            for k, (h, d) in (nvtx or {}).items()
        },
    )


def write_run(
    run_dir: Path,
    scenarios: list[ScenarioResult],
    requests: list[dict[str, Any]],
    *,
    prov: dict[str, Any] | None = None,
    cfg: dict[str, Any] | None = None,
    run_id: str | None = None,
    kernels: list[KernelRow] | None = None,
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    result = Result(
        run_id=run_id or run_dir.name,
        command="perfkit run synthetic.yaml",
        config=cfg or config(),
        provenance=provenance() if prov is None else prov,
        created_unix_s=1.8e9,
        status="complete",
        scenarios=scenarios,
        kernels=kernels,
    )
    path = write_result(run_dir / "result.json", result)
    if requests:
        (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def ab_run(
    run_dir: Path,
    *,
    repeats: int = 1,
    n: int = 50,
    shift: float = 0.0,
    seed: int = 0,
    arms: tuple[str, str] = ("triton", "dense"),
    scenario: str = "decode",
    prov: dict[str, Any] | None = None,
    hashes: tuple[str, str] = ("w0", "w0"),
) -> Path:
    """An interleaved two-arm run: B's latencies are A's scaled by (1 + shift), seeded lognormal noise."""
    rng = np.random.default_rng(seed)
    scen, reqs = [], []
    for rep in range(repeats):
        for k, arm in enumerate(arms):
            scale = 1.0 + (shift if k == 1 else 0.0)
            ttft = 50.0 * scale * rng.lognormal(0, 0.2, n)
            tpot = 10.0 * scale * rng.lognormal(0, 0.1, n)
            r = requests_for(scenario, arm, rep, ttft, tpot, t0_ns=rep * 10**10)
            reqs += r
            scen.append(
                scenario_from_requests(
                    scenario,
                    arm,
                    rep,
                    r,
                    workload_hash=hashes[k],
                    memory={"decode": (int(20 * GIB * scale), int(22 * GIB * scale))},
                    nvtx={"forward": (5.0 * scale, 4.5 * scale)},
                )
            )
    return write_run(run_dir, scen, reqs, prov=prov)
