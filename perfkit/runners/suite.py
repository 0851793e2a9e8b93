"""`perfkit run`: a whole suite, scenarios x arms x repeats on one loaded model per model entry.

    config -> provenance -> for each model: load once (weights, vision tower, engine + KV pool) ->
      for each scenario, for each repeat, for each arm (interleaved A B A B):
        set the arm's toggles on the live engine -> warmup prefills of a new toggle state (GPU) and warmup
        requests (excluded) -> measured requests ->
        metrics + capture summaries -> result appended and flushed to disk

A scenario that runs out of GPU memory is recorded with status `oom` and the run continues; any other failure
of one scenario is recorded as `error` (traceback in the run directory's errors.log) and the run continues.
Ctrl-C flushes what is done and exits 130.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from perfkit import provenance
from perfkit.config import ModelConfig, RunConfig, ScenarioConfig, Toggles, stable_hash
from perfkit.errors import PerfkitError
from perfkit.results import Result, RunWriter, ScenarioResult, WorkloadInfo, make_run_id
from perfkit.runners.serving import load_target, model_config_for


def default_config_path() -> Path:
    """The packaged smoke suite, run by `perfkit run` without a config."""
    return Path(str(importlib.resources.files("perfkit") / "smoke.yaml"))


def resolve_device(model: ModelConfig) -> str:
    import torch

    has_cuda = torch.cuda.is_available()
    if model.device == "cuda" and not has_cuda:
        raise PerfkitError(
            "model.device is cuda but no CUDA GPU is visible; run on a GPU machine or use --set model.device=auto"
        )
    if model.device == "auto":
        return "cuda" if has_cuda else "cpu"
    return model.device


def resolve_toggles(toggles: Toggles, device: str) -> Toggles:
    """Turn `auto` into a concrete backend and refuse combinations the machine cannot run."""
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    attention = toggles.attention
    if attention == "auto":
        attention = "flashinfer" if device == "cuda" and has_flashinfer else "torch"
    if attention == "flashinfer" and (device != "cuda" or not has_flashinfer):
        why = "no CUDA device" if device != "cuda" else "flashinfer is not installed (pip install -e .[gpu])"
        raise PerfkitError(f"toggles.attention=flashinfer cannot run here: {why}; use attention: torch or auto")
    cuda_graphs = toggles.cuda_graphs if (device == "cuda" and attention == "flashinfer") else "off"
    # the Triton mask runs on a CPU only under the interpreter; record what actually runs
    triton_ok = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    mask = toggles.mask if triton_ok else "dense"
    if toggles.fused_kernels == "on" and not triton_ok:
        raise PerfkitError("toggles.fused_kernels=on needs a CUDA GPU (or TRITON_INTERPRET=1 on a CPU); use off")
    fused = toggles.fused_kernels
    if fused == "auto":  # the fast path where it runs natively; the interpreter is for tests, not runs
        fused = "on" if device == "cuda" else "off"
    pdl = toggles.pdl
    if pdl != "off":
        ok = device == "cuda" and _pdl_available()
        if pdl == "on" and not ok:
            raise PerfkitError("toggles.pdl=on needs a CUDA GPU of compute capability 9.0 or newer (programmatic "
                               "dependent launch); use pdl: off or auto")  # fmt: skip
        pdl = "on" if ok else "off"
    return toggles.model_copy(update={"attention": attention, "cuda_graphs": cuda_graphs, "mask": mask,
                                      "fused_kernels": fused, "pdl": pdl})  # fmt: skip


def _pdl_available() -> bool:
    """The visible CUDA GPU runs programmatic dependent launch (imports torch and Triton: call on CUDA only)."""
    import torch

    from perfkit.kernels.pdl import pdl_available

    return pdl_available(torch.device("cuda"))


def _check_supported(cfg: RunConfig) -> None:
    """Refuse, in one line, configurations this perfkit cannot run. None at present: runtime.kv_dtype fp8 runs
    through both attention backends (the torch one on a CPU)."""


def run_suite(cfg: RunConfig, out_dir: Path | None, command: str, console: Console) -> int:
    """Run every scenario of `cfg`; returns the process exit code (0 ok, 1 some scenario failed, 130 Ctrl-C).

    Tensor parallelism (`runtime.tensor_parallel` = N > 1): this process is one of N torchrun ranks (`perfkit run
    --tp N` relaunches itself, see tp_launch). Every rank loads its shard and runs the same scenarios with the
    same engine steps; rank 0 alone prints and writes the run directory. After each scenario the ranks exchange
    their status, so a failure on any rank is recorded (by rank 0) and every rank drops its requests and
    continues. `runner: hf` scenarios are not run under TP: they are recorded with status error."""
    _check_supported(cfg)
    models = cfg.model_list()
    devices = {name: resolve_device(m) for name, m in models}
    arms = {name: [(a, resolve_toggles(t, devices[name])) for a, t in cfg.arm_list()] for name, _ in models}
    tp = _init_tp(cfg, devices)
    rank0 = tp is None or tp.is_rank0
    prov = provenance.collect() if rank0 else {}
    if tp is not None:
        from perfkit.runners.tp_launch import parallel_info

        info = parallel_info(tp)  # collective: every rank
        if rank0:
            prov["parallel"] = info
        console = console if rank0 else Console(quiet=True)
    writer: RunWriter | None = None
    if rank0:
        result = Result(
            run_id=make_run_id(cfg.name, cfg.output.label),
            command=command,
            config=cfg.model_dump(mode="json"),
            provenance=prov,
        )
        writer = RunWriter(out_dir or Path(cfg.output.dir), result)
    run_dir = Path(writer.dir if writer is not None else ".")
    if tp is not None:
        run_dir = Path(tp.broadcast_object(str(run_dir)))  # errors.rank<r>.log of the other ranks go there too
    tp_note = "" if tp is None else f" on {tp.world_size} tensor-parallel ranks ({tp.backend})"
    console.print(f"perfkit run [bold]{cfg.name}[/]: {len(cfg.scenarios)} scenarios x {len(cfg.arm_list())} arms x "
                  f"{cfg.repeats} repeats{tp_note} -> {run_dir}")
    failures = 0
    target: Any = None
    if tp is not None:  # torchrun stops the ranks with SIGTERM (Ctrl-C, another rank died): flush like Ctrl-C
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        for model_name, mcfg in models:
            prefix = f"{model_name}/" if len(models) > 1 else ""
            device = devices[model_name]
            # the engine's scenarios first, then the HF peer's: each target holds the GPU alone
            for runner in ("engine", "hf"):
                scenarios = cfg.scenarios_of(model_name, runner)
                if not scenarios:
                    continue
                if runner == "hf" and tp is not None:  # the HF peer is single-GPU: recorded, not run
                    for scenario in scenarios:
                        for repeat in range(cfg.repeats):
                            res = _base_result(scenario, prefix + scenario.name, "hf", None, repeat).model_copy(
                                update={"status": "error", "message": f"runner hf is not run under tensor "
                                        f"parallelism (TP={tp.world_size}); run it in a --tp 1 suite"})  # fmt: skip
                            failures += 1
                            if writer is not None:
                                writer.add_scenario(res, [])
                            _print_line(console, res)
                    continue
                console.print(f"loading {model_name} for the {runner} runner on {device} ...")
                target = _load(runner, cfg, mcfg, device, run_dir, arms[model_name][0][1], tp)
                console.print(target.describe())
                for scenario in scenarios:
                    for repeat in range(cfg.repeats):
                        for arm_name, toggles in arms[model_name] if runner == "engine" else [("hf", None)]:
                            res, lines = _run_one(target, scenario, prefix + scenario.name, arm_name, toggles,
                                                  repeat, run_dir, console, rank=0 if tp is None else tp.rank)
                            if tp is not None:
                                res, lines = _agree(tp, target, res, lines)
                            failures += res.status != "ok"
                            if writer is not None:
                                writer.add_scenario(res, lines)
                            _print_line(console, res)
                target.close()
                target = None
    except KeyboardInterrupt:  # under torchrun every rank gets the signal; no collectives from here on
        if tp is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the flush short
        if target is not None:
            target.close()
        if writer is None:
            return 130
        path = writer.finish("interrupted")
        console.print(f"[yellow]interrupted[/]: {len(writer.result.scenarios)} finished scenarios kept in {path}")
        return 130
    except BaseException:
        if writer is not None:
            writer.finish("failed")
        raise
    if writer is not None:
        path = writer.finish("complete")
        print_summary(console, writer.result)
        console.print(f"result: {path}")
    if tp is not None:
        tp.shutdown()  # barrier first: rank 0 (the rendezvous store) leaves last
    return 1 if failures else 0


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _init_tp(cfg: RunConfig, devices: dict[str, str]) -> Any:
    """This rank's TPContext when runtime.tensor_parallel > 1 (the process must be one of its torchrun ranks),
    else None."""
    n = cfg.runtime.tensor_parallel
    if n == 1:
        return None
    kinds = set(devices.values())
    if len(kinds) != 1:
        raise PerfkitError(f"runtime.tensor_parallel={n}: every model must run on the same device kind (got "
                           f"{', '.join(sorted(kinds))})")  # fmt: skip
    from perfkit.runners.tp_launch import in_torchrun, init_tp

    if not in_torchrun():
        raise PerfkitError(f"runtime.tensor_parallel={n} runs as {n} torchrun ranks: start it with "
                           f"`perfkit run CONFIG --tp {n}` (it relaunches itself through torchrun)")  # fmt: skip
    ctx = init_tp(device=kinds.pop())
    if ctx.world_size != n:
        raise PerfkitError(f"runtime.tensor_parallel={n} but torchrun started {ctx.world_size} ranks")
    return ctx


def _agree(tp: Any, target: Any, res: ScenarioResult, lines: list[dict[str, Any]]) -> tuple[ScenarioResult, list]:
    """After a scenario, on every rank: gather every rank's outcome. A failure anywhere fails the scenario
    everywhere (ranks that succeeded drop their requests too, so the engines stay identical); ranks that
    finished with different token counts or step counts diverged (an error). Rank 0's result carries it."""
    mine = (res.status, res.message, res.counts.output_tokens if res.counts else None, res.runtime.get("steps"))
    every = tp.all_gather_object(mine)
    bad = [(r, st, msg) for r, (st, msg, _, _) in enumerate(every) if st != "ok"]
    if not bad and len({(o, n) for _, _, o, n in every}) > 1:
        detail = ", ".join(f"rank {r}: {o} tokens in {n} steps" for r, (_, _, o, n) in enumerate(every))
        bad = [(0, "error", f"tensor parallel ranks diverged ({detail})")]
    if not bad:
        return res, lines
    if res.status == "ok":
        target.recover()
    r, status, msg = next(((r, st, m) for r, st, m in bad if st == "oom"), bad[0])
    status = "oom" if any(st == "oom" for _, st, _ in bad) else status
    where = f"rank {r}: " if not (msg or "").startswith("tensor parallel") else ""
    return res.model_copy(update={"status": status, "message": f"{where}{msg or ''}"[:500]}), []


def _load(
    runner: str, cfg: RunConfig, mcfg: ModelConfig, device: str, run_dir: Path, toggles: Toggles, tp: Any = None
) -> Any:
    if runner == "hf":
        from perfkit.runners.hf_peer import load_hf_target

        return load_hf_target(cfg, mcfg, device, model_config_for(mcfg))
    return load_target(cfg, mcfg, device, run_dir, toggles, tp)


def _run_one(
    target: Any,
    scenario: ScenarioConfig,
    name: str,
    arm_name: str,
    toggles: Toggles | None,
    repeat: int,
    run_dir: Path,
    console: Console,
    rank: int = 0,
) -> tuple[ScenarioResult, list[dict[str, Any]]]:
    base = _base_result(scenario, name, arm_name, toggles, repeat)
    total = scenario.num_requests
    with Progress(
        TextColumn(escape(f"{name} [{arm_name} #{repeat}]")),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} req"),
        TextColumn("{task.fields[tok_s]:>8.1f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("run", total=total, tok_s=0.0)

        def on_progress(done: int, tok_s: float) -> None:
            progress.update(task, completed=done, tok_s=tok_s)

        try:
            res, lines = target.run_scenario(scenario, base, toggles, on_progress)
        except PerfkitError:
            raise
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - recorded per scenario, the run continues
            target.recover()
            status = "oom" if _is_oom(err) else "error"
            with open(run_dir / ("errors.log" if rank == 0 else f"errors.rank{rank}.log"), "a") as f:
                f.write(f"--- {name} arm={arm_name} repeat={repeat}\n{traceback.format_exc()}\n")
            msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return base.model_copy(update={"status": status, "message": msg[:500]}), []
    return res, lines


def _base_result(
    scenario: ScenarioConfig, name: str, arm_name: str, toggles: Toggles | None, repeat: int
) -> ScenarioResult:
    return ScenarioResult(
        name=name,
        arm_name=arm_name,
        arm=toggles.model_dump() if toggles is not None else {"runner": "hf"},
        repeat=repeat,
        runner=scenario.runner,
        workload=WorkloadInfo(spec=scenario.workload.model_dump(mode="json"),
                              hash=stable_hash(scenario.model_dump(mode="json"))),
        started_unix_s=time.time(),
    )


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _label(res: ScenarioResult) -> str:
    return f"{res.name} [{res.arm_name} #{res.repeat}]"


def _print_line(console: Console, res: ScenarioResult) -> None:
    if res.status != "ok":
        console.print(f"  {escape(_label(res))}: [red]{res.status}[/] {escape(res.message or '')}")
        return
    m, t = res.metrics, res.throughput
    console.print(
        f"  {escape(_label(res))}: TTFT p50 {_fmt(m['ttft_ms'].p50)} ms, "
        f"TPOT p50 {_fmt(m['tpot_ms'].p50, '.2f')} ms, {_fmt(t.output_tok_s if t else None)} out tok/s"
    )
    if res.message:  # an ok scenario with a caveat (a JIT compile inside the measured window)
        console.print(f"    [yellow]warning[/]: {escape(res.message)}")


def print_summary(console: Console, result: Result) -> None:
    """The end-of-run table: one row per scenario x arm x repeat."""
    table = Table(title=f"perfkit run {result.run_id}", show_lines=False)
    for col in ("scenario", "arm", "rep", "status", "req", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                "ITL p99 ms", "out tok/s", "ceiling tok/s", "serial ceiling", "peak mem GiB", "bound ms", "MBU", "MFU"):
        table.add_column(col, justify="left" if col in ("scenario", "arm", "status") else "right")
    for s in result.scenarios:
        m = s.metrics
        peak = None
        if s.memory is not None and s.memory.available:
            scen = [p for k, p in s.memory.phases.items() if k.startswith("scenario:")]
            peak = max((p.peak_allocated_bytes for p in scen), default=None)
        rf = s.roofline
        table.add_row(
            s.name, s.arm_name, str(s.repeat), s.status,
            str(s.counts.requests) if s.counts else "-",
            _fmt(m["ttft_ms"].p50) if "ttft_ms" in m else "-",
            _fmt(m["ttft_ms"].p99) if "ttft_ms" in m else "-",
            _fmt(m["tpot_ms"].p50, ".2f") if "tpot_ms" in m else "-",
            _fmt(m["itl_ms"].p99, ".2f") if "itl_ms" in m else "-",
            _fmt(s.throughput.output_tok_s) if s.throughput else "-",
            _fmt(rf.output_tok_s_bound if rf else None),
            _fmt(rf.output_tok_s_bound_serial if rf else None),
            _fmt(peak / 2**30 if peak else None, ".2f"),
            _fmt(rf.decode_bound_ms if rf else None, ".2f"),
            _fmt(rf.mbu if rf else None, ".2f"),
            _fmt(rf.mfu if rf else None, ".2f"),
        )  # fmt: skip
    console.print(table)
